//! Reductions of bf16 and f16 tensors in their own dtype. MPI has no 16-bit float datatype, so
//! these tensors travel as 16-bit integers (`MPI_UINT16_T`) under user-defined operations
//! (`MPI_Op_create`, commutative) that take each pair of elements to f32, add them (or take
//! their max or min) and round the result back to the 16-bit type, to nearest even. That is
//! what PyTorch's gloo backend does for `c10::BFloat16` and `c10::Half` (elementwise
//! `a + b` of the 16-bit type) and NCCL does on the GPU: every step of the reduction rounds.
//! At two ranks the result equals an f32 reduction rounded once (one addition); at three and
//! more, the rounding of each partial sum may differ from it in the last bit.
//!
//! Before these operations, 16-bit reductions went through an f32 copy of the tensor: twice
//! the bytes on the wire, a fresh allocation (above glibc's mmap threshold for a large unit,
//! faulted in on every step) and two casts.
//!
//! # Safety
//!
//! MPI calls each operation with `len` elements of the datatype at `invec` and at `inoutvec`;
//! the operations are only ever registered for `MPI_UINT16_T` buffers of that dtype (see
//! [`op_for`]), read and write them unaligned, and never keep the pointers.

use crate::dist::ReduceOp;
use crate::Result;
use half::{bf16, f16};
use mpi::ffi;
use std::ffi::{c_int, c_void};
use std::sync::OnceLock;
use tch::Kind;

/// A 16-bit float that widens to f32 exactly and rounds back to nearest even.
trait Half16: Copy {
    fn widen(self) -> f32;
    fn narrow(x: f32) -> Self;
}

impl Half16 for bf16 {
    /// The bits shifted into f32's upper half (exact; no branch).
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
    /// libtorch's `c10::round_to_nearest_even` bit for bit, NaN included (`0x7FC0`): three
    /// integer operations that the compiler vectorises, where `bf16::from_f32`'s branches kept
    /// the loop scalar (3× slower: 60 against 20 ms for 37.7 M elements, fc1's at width 4096).
    #[inline(always)]
    fn narrow(x: f32) -> Self {
        let bits = x.to_bits();
        let rounded = (bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16) as u16;
        bf16::from_bits(if x.is_nan() { 0x7FC0 } else { rounded })
    }
}

impl Half16 for f16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
    fn narrow(x: f32) -> Self {
        f16::from_f32(x)
    }
}

/// The three reductions, as f32 functions of two elements.
const SUM: u8 = 0;
const MAX: u8 = 1;
const MIN: u8 = 2;

fn combine<const OP: u8>(a: f32, b: f32) -> f32 {
    match OP {
        SUM => a + b,
        // NaN propagates, as torch.maximum/minimum (and f32 MPI_MAX on x86 does not promise).
        MAX if a.is_nan() || b.is_nan() => f32::NAN,
        MAX => a.max(b),
        _ if a.is_nan() || b.is_nan() => f32::NAN,
        _ => a.min(b),
    }
}

/// The `MPI_User_function`: `inout[i] = narrow(combine(widen(in[i]), widen(inout[i])))`.
unsafe extern "C" fn reduce<T: Half16, const OP: u8>(
    invec: *mut c_void,
    inoutvec: *mut c_void,
    len: *mut c_int,
    _ty: *mut ffi::MPI_Datatype,
) {
    // SAFETY: MPI passes a valid `len` and two buffers of `len` 16-bit elements (module's
    // `# Safety`); unaligned reads and writes need no alignment.
    unsafe {
        let n = usize::try_from(*len).unwrap_or(0);
        let (src, dst) = (invec as *const T, inoutvec as *mut T);
        for i in 0..n {
            let a = src.add(i).read_unaligned().widen();
            let b = dst.add(i).read_unaligned().widen();
            dst.add(i).write_unaligned(T::narrow(combine::<OP>(a, b)));
        }
    }
}

/// The six operation handles: `[bf16, f16] × [sum, max, min]`, created once per process.
struct HalfOps([[ffi::MPI_Op; 3]; 2]);

// SAFETY: MPI operation handles are process-wide constants once created; they are only read.
unsafe impl Send for HalfOps {}
// SAFETY: as above.
unsafe impl Sync for HalfOps {}

static OPS: OnceLock<HalfOps> = OnceLock::new();

/// Creates the operations (`MPI_Op_create`); idempotent. Call after `MPI_Init`.
///
/// # Errors
/// What `check` makes of a failed `MPI_Op_create` (the group's [`Error::Backend`]).
pub(super) fn create(check: impl Fn(&'static str, c_int) -> Result<()>) -> Result<()> {
    if OPS.get().is_some() {
        return Ok(());
    }
    let fns: [[ffi::MPI_User_function; 3]; 2] = [
        [Some(reduce::<bf16, SUM>), Some(reduce::<bf16, MAX>), Some(reduce::<bf16, MIN>)],
        [Some(reduce::<f16, SUM>), Some(reduce::<f16, MAX>), Some(reduce::<f16, MIN>)],
    ];
    // SAFETY: reading a predefined handle, a placeholder every slot overwrites.
    let mut ops = [[unsafe { ffi::RSMPI_SUM }; 3]; 2];
    for (k, row) in fns.iter().enumerate() {
        for (o, f) in row.iter().enumerate() {
            // SAFETY: MPI is initialised (caller); `f` has MPI_User_function's signature and
            // the out-pointer is valid.
            check("MPI_Op_create", unsafe { ffi::MPI_Op_create(*f, 1, &mut ops[k][o]) })?;
        }
    }
    let _ = OPS.set(HalfOps(ops));
    Ok(())
}

/// The operation reducing `kind` with `op` (`Avg` sums; the caller divides), `None` for a kind
/// MPI reduces natively.
pub(super) fn op_for(kind: Kind, op: ReduceOp) -> Option<ffi::MPI_Op> {
    let k = match kind {
        Kind::BFloat16 => 0,
        Kind::Half => 1,
        _ => return None,
    };
    let o = match op {
        ReduceOp::Sum | ReduceOp::Avg => SUM,
        ReduceOp::Max => MAX,
        ReduceOp::Min => MIN,
    };
    let ops = OPS.get().expect("MpiGroup::init creates the 16-bit operations before any collective");
    Some(ops.0[k][usize::from(o)])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn apply<T: Half16, const OP: u8>(a: &[T], b: &mut [T]) {
        let mut n = a.len() as c_int;
        // SAFETY: two buffers of `n` elements, as MPI passes them.
        unsafe { reduce::<T, OP>(a.as_ptr() as *mut c_void, b.as_mut_ptr() as *mut c_void, &mut n, std::ptr::null_mut()) };
    }

    #[test]
    fn sum_rounds_the_f32_sum_to_nearest_even_as_libtorch() {
        // Pairs whose f32 sum falls between two bf16 values, at and off the midpoint, and
        // values whose sum overflows or is NaN.
        let xs = [1.0f32, 1.0, 256.0, -3.5, 1e38, f32::NAN, 0.1, -0.0];
        let ys = [0.00390625f32, 0.01171875, 1.0, 3.5, 3e38, 1.0, 0.2, -0.0];
        let a: Vec<bf16> = xs.iter().map(|&x| bf16::from_f32(x)).collect();
        let mut b: Vec<bf16> = ys.iter().map(|&y| bf16::from_f32(y)).collect();
        let wide: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x.to_f32() + y.to_f32()).collect();
        apply::<bf16, SUM>(&a, &mut b);
        // libtorch's own rounding of the same f32 sums, bit for bit; NaN as a NaN (its
        // vectorised cast writes 0xFFFF, its scalar one — gloo's, and ours — 0x7FC0).
        let want = Vec::<i16>::try_from(tch::Tensor::from_slice(&wide).to_kind(Kind::BFloat16).view_dtype(Kind::Int16)).unwrap();
        for (i, (got, want)) in b.iter().zip(&want).enumerate() {
            let want = bf16::from_bits(*want as u16);
            assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "element {i}: {got} vs {want}");
        }
        assert_eq!(b[5].to_bits(), 0x7FC0, "c10's NaN");
        assert_eq!(b[0].to_f32(), 1.0, "1 + 2^-8 is a tie: to even, 1");
        assert_eq!(b[1].to_f32(), 1.015625, "1 + 3·2^-8 is a tie: to even, 1 + 2^-6");
        assert_eq!(b[2].to_f32(), 256.0, "256 + 1 rounds to 256 in bf16's 8 bits");
        assert!(b[4].to_f32().is_infinite() && b[5].is_nan());
    }

    #[test]
    fn f16_sum_max_min_and_nan() {
        let a = [f16::from_f32(1.5), f16::from_f32(-2.0), f16::from_f32(65504.0), f16::NAN];
        let mut s = [f16::from_f32(0.25), f16::from_f32(3.0), f16::from_f32(65504.0), f16::ONE];
        let (mut mx, mut mn) = (s, s);
        apply::<f16, SUM>(&a, &mut s);
        apply::<f16, MAX>(&a, &mut mx);
        apply::<f16, MIN>(&a, &mut mn);
        assert_eq!(s[..2].iter().map(|x| x.to_f32()).collect::<Vec<_>>(), [1.75, 1.0]);
        assert!(s[2].is_infinite(), "65504 + 65504 overflows f16");
        assert_eq!(mx[..3].iter().map(|x| x.to_f32()).collect::<Vec<_>>(), [1.5, 3.0, 65504.0]);
        assert_eq!(mn[..3].iter().map(|x| x.to_f32()).collect::<Vec<_>>(), [0.25, -2.0, 65504.0]);
        assert!(s[3].is_nan() && mx[3].is_nan() && mn[3].is_nan(), "NaN propagates");
    }
}

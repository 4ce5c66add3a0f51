//! Writing tensors to a `.safetensors` file without copying them first.
//!
//! tch's `Tensor::write_safetensors` copies each tensor into a fresh `Vec<u8>` before writing it,
//! so a save holds one more copy of its largest tensor (fc1's weight at width 4096 is 144 MiB,
//! and its AdamW moments as much again): on rank 0, at the end of training, that copy is the
//! peak. Here the safetensors crate (the format's reference implementation, the version tch
//! links) reads each contiguous CPU tensor's bytes in place. The file is the same byte for byte.

use crate::Result;
use std::borrow::Cow;
use std::path::Path;
use tch::{Device, Tensor};

/// One tensor as the safetensors writer sees it: its dtype, shape and bytes (its own where it
/// can, a copy otherwise).
struct TensorView<'a> {
    tensor: &'a Tensor,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
}

impl safetensors::View for TensorView<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let len = self.data_len();
        if len == 0 {
            return Cow::Borrowed(&[]);
        }
        if self.tensor.device() != Device::Cpu || !self.tensor.is_contiguous() {
            // A copy on the CPU, made when the writer reaches this tensor and dropped once it
            // is written (tch's own writer does the same, and panics as it does if it fails).
            let mut bytes = vec![0u8; len];
            self.tensor.to_device(Device::Cpu).contiguous().copy_data_u8(&mut bytes, self.tensor.numel());
            return Cow::Owned(bytes);
        }
        // SAFETY: a contiguous CPU tensor's `data_ptr` is the first of `numel` elements laid
        // out back to back: `len` readable bytes, kept alive by the borrowed tensor. Nothing
        // writes to it meanwhile: the ranks save between steps, on the training thread.
        Cow::Borrowed(unsafe { std::slice::from_raw_parts(self.tensor.data_ptr() as *const u8, len) })
    }
    fn data_len(&self) -> usize {
        self.tensor.numel() * self.tensor.kind().elt_size_in_bytes()
    }
}

/// Writes `tensors` (name, tensor; any device, any layout) to the safetensors file `path`,
/// replacing it. Contiguous CPU tensors are written from their own storage; others are copied
/// to a contiguous CPU buffer one at a time, as the writer reaches them. The same file as
/// `Tensor::write_safetensors` writes (tensors ordered by dtype alignment, then name).
///
/// # Errors
/// [`crate::Error::Torch`] for a sparse tensor or a dtype safetensors has no name for, and for
/// a file that cannot be written, naming `path`.
pub fn write(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let views = tensors
        .iter()
        .map(|(name, t)| {
            if t.is_sparse() {
                return Err(tch::TchError::Convert(format!("{name}: cannot save a sparse tensor")));
            }
            let dtype = safetensors::Dtype::try_from(t.kind())?;
            let shape = t.size().iter().map(|&d| d as usize).collect();
            Ok((name.as_str(), TensorView { tensor: t, dtype, shape }))
        })
        .collect::<std::result::Result<Vec<_>, tch::TchError>>()?;
    safetensors::tensor::serialize_to_file(views, &None, path)
        .map_err(|e| tch::TchError::FileFormat(format!("{}: {e:?}", path.display())))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    /// The file is tch's byte for byte, for every dtype the checkpoints hold, a strided view,
    /// a 0-d tensor and an empty one; it reads back equal.
    #[test]
    fn the_file_is_tchs_byte_for_byte_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let wide = Tensor::arange(24, (Kind::Float, Device::Cpu)).view([4, 6]);
        let tensors: Vec<(String, Tensor)> = vec![
            ("w".into(), Tensor::randn([3, 5], (Kind::Float, Device::Cpu))),
            ("b".into(), Tensor::randn([7], (Kind::BFloat16, Device::Cpu))),
            ("step".into(), Tensor::from(42i64)),
            ("t".into(), wide.tr()),
            ("narrow".into(), wide.narrow(0, 1, 2)),
            ("empty".into(), Tensor::zeros([0, 3], (Kind::Double, Device::Cpu))),
            ("h".into(), Tensor::randn([2, 2], (Kind::Half, Device::Cpu))),
        ];
        let ours = dir.path().join("ours.safetensors");
        write(&ours, &tensors).unwrap();
        let contiguous: Vec<(String, Tensor)> = tensors.iter().map(|(n, t)| (n.clone(), t.contiguous())).collect();
        let theirs = dir.path().join("tch.safetensors");
        Tensor::write_safetensors(&contiguous, &theirs).unwrap();
        assert_eq!(std::fs::read(&ours).unwrap(), std::fs::read(&theirs).unwrap());
        let back = Tensor::read_safetensors(&ours).unwrap();
        assert_eq!(back.len(), tensors.len());
        for (name, t) in &tensors {
            let (_, b) = back.iter().find(|(n, _)| n == name).unwrap();
            assert_eq!((b.size(), b.kind()), (t.size(), t.kind()), "{name}");
            assert!(b.equal(t), "{name}");
        }
    }

    #[test]
    fn a_directory_that_cannot_be_written_is_named() {
        let e = write(Path::new("/nonexistent-dir/x.safetensors"), &[("a".into(), Tensor::from(1.0f32))]).unwrap_err();
        assert!(e.to_string().contains("/nonexistent-dir/x.safetensors"), "{e}");
    }
}

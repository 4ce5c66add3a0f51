//! "Same math, less work": BasicNet's forward (max-pool before ReLU) gives bit-identical outputs
//! and gradients to the tutorial's op chain (ReLU before max-pool), on random input, with and
//! without dropout; and evaluation in pieces of `EVAL_PIECE` images gives the whole batch's
//! log-probabilities, loss and count.

use ladder_core::model::{channels_last, dropout, BasicNet, BasicNetConfig, Model};
use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Tensor};

/// The tutorial's `Net.forward`, op for op, with `net`'s own weights (and the model's dropout,
/// whose masks are its own; see dropout.rs), on the input in channels-last order, as PyTorch's
/// performance guide has it and as the model runs on CPU.
fn tutorial_forward(net: &BasicNet, x: &Tensor, drop: bool) -> Tensor {
    let p: Vec<Tensor> = net.named_parameters().into_iter().map(|(_, t)| t).collect();
    let y = channels_last(x).conv2d(&p[0], Some(&p[1]), [1, 1], [0, 0], [1, 1], 1).relu();
    let y = y.conv2d(&p[2], Some(&p[3]), [1, 1], [0, 0], [1, 1], 1).relu().max_pool2d_default(2);
    let y = dropout(&y, 0.25, drop).flatten(1, -1).linear(&p[4], Some(&p[5])).relu();
    let y = dropout(&y, 0.5, drop);
    y.linear(&p[6], Some(&p[7])).log_softmax(-1, Kind::Float)
}

fn bits(t: &Tensor) -> Vec<i32> {
    Vec::<i32>::try_from(&t.contiguous().view_dtype(Kind::Int).flatten(0, -1)).unwrap()
}

/// Output and every parameter's gradient after `nll_loss(forward).backward()`.
fn run(net: &BasicNet, x: &Tensor, y: &Tensor, forward: impl Fn(&Tensor) -> Tensor) -> Vec<Vec<i32>> {
    let params = net.named_parameters();
    for (_, p) in &params {
        let mut p = p.shallow_clone();
        p.zero_grad();
    }
    tch::manual_seed(77); // the same dropout masks for both formulations
    let out = forward(x);
    out.nll_loss(y).backward();
    let mut all = vec![bits(&out)];
    all.extend(params.iter().map(|(_, p)| bits(&p.grad())));
    all
}

#[test]
fn pool_before_relu_gives_bit_identical_outputs_and_gradients() {
    tch::manual_seed(5);
    for dropout in [false, true] {
        let vs = nn::VarStore::new(Device::Cpu);
        let net = BasicNet::new(&vs.root(), BasicNetConfig { dropout, ..Default::default() });
        // Normal input, and an input whose conv2 windows are often all negative (ReLU's zero side).
        for shift in [0.0, -3.0] {
            let x = Tensor::randn([32, 1, 28, 28], (Kind::Float, Device::Cpu)) + shift;
            let y = Tensor::randint(10, [32], (Kind::Int64, Device::Cpu));
            let ours = run(&net, &x, &y, |x| net.forward_t(x, true));
            let theirs = run(&net, &x, &y, |x| tutorial_forward(&net, x, dropout));
            assert_eq!(ours.len(), 9);
            for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                let what = if i == 0 { "output".to_string() } else { net.named_parameters()[i - 1].0.clone() };
                assert!(a == b, "dropout {dropout}, shift {shift}: {what} differs");
            }
            // Not vacuous: gradients are there and not all zero.
            assert!(ours[1..].iter().all(|g| g.iter().any(|&v| v != 0)));
        }
    }
}

/// The tutorial's test batch of 1,000 images, evaluated in pieces of `EVAL_PIECE` (128): every
/// image's log-probabilities are the bits of one whole-batch forward, so the loss sum and the
/// count of correct predictions are the whole batch's exactly.
#[test]
fn evaluation_in_pieces_equals_the_whole_batch() {
    tch::manual_seed(5);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = BasicNet::new(&vs.root(), BasicNetConfig::default());
    let x = Tensor::randn([1000, 1, 28, 28], (Kind::Float, Device::Cpu));
    let y = Tensor::randint(10, [1000], (Kind::Int64, Device::Cpu));
    let whole = tch::no_grad(|| net.forward_t(&x, false));
    let data = ladder_core::data::Dataset::from_tensors(x.shallow_clone(), y.shallow_clone()).unwrap();
    let mut pieces = Vec::new();
    let sums = ladder_core::eval::evaluate_with(
        |b| {
            pieces.push(b.size()[0]);
            Ok(net.forward_t(b, false))
        },
        &data,
        1000,
    )
    .unwrap();
    assert_eq!(pieces, [128, 128, 128, 128, 128, 128, 128, 104], "eight pieces of at most EVAL_PIECE");
    let whole_correct = whole.argmax(-1, false).eq_tensor(&y).sum(Kind::Int64).int64_value(&[]);
    assert_eq!((sums.count, sums.correct), (1000, whole_correct));
    assert_eq!(sums.loss_sum, whole.nll_loss(&y).double_value(&[]) * 1000.0, "the whole batch's loss, bit for bit");
}

/// `max_pool2d_2x2` (model_shim.cpp's autograd function), on an NCHW and on a channels-last
/// input (its two kernels), against libtorch's NCHW `max_pool2d(2)`: the same values and the
/// same input gradient, bit for bit, in f32, bf16, f16 and f64 — on random values; on small integers where windows hold ties (the first maximum of
/// a window must get the gradient, as libtorch's kernel gives it); and on special values (NaN,
/// ±∞, ±0) with special gradients (NaN, ±0), where a NaN wins its window and −0 gradients
/// arrive as +0, as in libtorch. Bits are compared, so NaN payloads and zero signs count.
#[test]
fn max_pool_equals_libtorch_max_pool_with_ties_and_special_values() {
    tch::manual_seed(9);
    let specials = Tensor::from_slice(&[f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0, 1.0, -1.0, 2.0]);
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half, Kind::Double] {
        let as_bits = |t: &Tensor| {
            let int = match kind {
                Kind::Double => Kind::Int64,
                Kind::Float => Kind::Int,
                _ => Kind::Int16,
            };
            t.contiguous().view_dtype(int)
        };
        for input in ["random", "ties", "special"] {
            let ties = input == "ties";
            let (x, g) = match input {
                "random" => (
                    Tensor::randn([4, 8, 24, 24], (kind, Device::Cpu)),
                    Tensor::randn([4, 8, 12, 12], (Kind::Float, Device::Cpu)).to_kind(kind),
                ),
                "ties" => (
                    Tensor::randint(3, [4, 8, 24, 24], (Kind::Int64, Device::Cpu)).to_kind(kind),
                    Tensor::randn([4, 8, 12, 12], (Kind::Float, Device::Cpu)).to_kind(kind),
                ),
                _ => (
                    specials
                        .index_select(0, &Tensor::randint(8, [4 * 8 * 24 * 24], (Kind::Int64, Device::Cpu)))
                        .view([4, 8, 24, 24])
                        .to_kind(kind),
                    specials
                        .index_select(0, &Tensor::randint(8, [4 * 8 * 12 * 12], (Kind::Int64, Device::Cpu)))
                        .view([4, 8, 12, 12])
                        .to_kind(kind),
                ),
            };
            let grad_of = |x: &Tensor, pool: &dyn Fn(&Tensor) -> Tensor| {
                let x = x.detach().set_requires_grad(true);
                let y = pool(&x);
                (&y * &g).sum(kind).backward(); // d/dy = g exactly (1 · g, NaN and −0 included)
                (y.detach(), x.grad())
            };
            let (theirs, theirs_grad) = grad_of(&x, &|x| x.max_pool2d_default(2));
            for layout in ["NCHW", "channels-last"] {
                let laid_out = if layout == "NCHW" { x.shallow_clone() } else { channels_last(&x) };
                let (ours, ours_grad) = grad_of(&laid_out, &|x| ladder_core::model::max_pool2d_2x2(x));
                assert_eq!(ours.size(), [4, 8, 12, 12]);
                assert!(ours.is_contiguous(), "{layout}: the output is contiguous NCHW");
                // The input gradient comes in the input's layout (what conv2's backward wants).
                assert_eq!(ours_grad.stride(), laid_out.stride(), "{kind:?} {input}: {layout} gradient's strides");
                assert!(as_bits(&ours).equal(&as_bits(&theirs)), "{kind:?} {input} {layout}: values differ");
                assert!(as_bits(&ours_grad).equal(&as_bits(&theirs_grad)), "{kind:?} {input} {layout}: gradients differ");
            }
            if input == "special" {
                // Not vacuous: NaNs won windows, and −0 gradients were given.
                assert_eq!(theirs.isnan().any().int64_value(&[]), 1);
                assert_eq!(g.eq(0.0).logical_and(&g.signbit()).any().int64_value(&[]), 1);
            }
            if ties {
                // Not vacuous: some windows do hold a repeated maximum.
                let w = x.view([4, 8, 12, 2, 12, 2]);
                let m = theirs.view([4, 8, 12, 1, 12, 1]);
                let per_window = w.eq_tensor(&m).sum_dim_intlist([3, 5].as_slice(), false, Kind::Int64);
                assert!(per_window.gt(1).any().int64_value(&[]) == 1, "no tie in the test input");
            }
        }
    }
}

/// The same equality on the layouts and shapes BasicNet does not produce: a non-square plane
/// (6 × 10, so swapped height and width would show), a channels-last input, a transposed view
/// of an input, and an expanded upstream gradient (`y.sum().backward()`).
#[test]
fn max_pool_equals_libtorch_on_other_layouts_and_shapes() {
    tch::manual_seed(11);
    let base = Tensor::randn([2, 3, 6, 10], (Kind::Float, Device::Cpu));
    let inputs = [
        ("non-square", base.shallow_clone()),
        ("channels-last", base.permute([0, 2, 3, 1]).contiguous().permute([0, 3, 1, 2])),
        ("transposed view", Tensor::randn([2, 3, 10, 6], (Kind::Float, Device::Cpu)).transpose(2, 3)),
    ];
    for (what, x0) in inputs {
        for expanded in [false, true] {
            let run = |pool: &dyn Fn(&Tensor) -> Tensor| {
                let x = x0.detach().set_requires_grad(true);
                let y = pool(&x);
                if expanded {
                    y.sum(Kind::Float).backward(); // the gradient reaching the pool is expanded
                } else {
                    (&y * y.detach().cos()).sum(Kind::Float).backward();
                }
                (y.detach().contiguous(), x.grad().contiguous())
            };
            let (ours, ours_grad) = run(&|x| ladder_core::model::max_pool2d_2x2(x));
            let (theirs, theirs_grad) = run(&|x| x.max_pool2d_default(2));
            assert_eq!(ours.size(), [2, 3, 3, 5], "{what}");
            assert!(ours.equal(&theirs), "{what}, expanded {expanded}: values differ");
            assert!(ours_grad.equal(&theirs_grad), "{what}, expanded {expanded}: gradients differ");
        }
    }
}

/// The max-pool's kernels split their work over libtorch's intra-op threads (OpenMP, as
/// libtorch's own; a shim compiled without it ran them on one thread): at 1, 2 and 4 threads,
/// on BasicNet's channels-last shape and on NCHW planes (more than one grain of 8 planes per
/// thread), in f32 and bf16, the same bits as libtorch's max-pool, values and gradients.
#[test]
fn max_pool_is_libtorchs_at_any_thread_count() {
    /// Restores the thread count the process started with however the test ends.
    struct Restore(i32);
    impl Drop for Restore {
        fn drop(&mut self) {
            tch::set_num_threads(self.0);
        }
    }
    let _restore = Restore(tch::get_num_threads());
    tch::manual_seed(12);
    for kind in [Kind::Float, Kind::BFloat16] {
        let cl = channels_last(&Tensor::randn([8, 64, 24, 24], (Kind::Float, Device::Cpu)).to_kind(kind));
        let nchw = Tensor::randn([4, 40, 6, 10], (Kind::Float, Device::Cpu)).to_kind(kind);
        for (what, x0) in [("channels-last", cl), ("NCHW", nchw)] {
            let run = |pool: &dyn Fn(&Tensor) -> Tensor| {
                let x = x0.detach().set_requires_grad(true);
                let y = pool(&x);
                (&y * y.detach().cos()).sum(Kind::Float).backward();
                (y.detach().contiguous(), x.grad().contiguous())
            };
            tch::set_num_threads(1);
            let (theirs, theirs_grad) = run(&|x| x.max_pool2d_default(2));
            for threads in [1, 2, 4] {
                tch::set_num_threads(threads);
                let (ours, ours_grad) = run(&|x| ladder_core::model::max_pool2d_2x2(x));
                assert!(ours.equal(&theirs), "{kind:?} {what}, {threads} threads: values differ");
                assert!(ours_grad.equal(&theirs_grad), "{kind:?} {what}, {threads} threads: gradients differ");
            }
        }
    }
}

//! `model::dropout` (noise from model_shim.cpp's counter-based generator) behaves as
//! `torch.nn.functional.dropout`: each element kept with probability 1 − p and scaled by
//! libtorch's 1/(1 − p), the others exactly 0; the gradient is the upstream gradient times the
//! same noise; identity in eval mode and at p = 0. Its masks are a function of libtorch's
//! generator state (seeded → reproducible, whatever the thread count) and independent between
//! elements, including the two that share one 64-bit random word.

use ladder_core::model::dropout;
use tch::{Device, Kind, Tensor};

const N: i64 = 1 << 20;

/// The tests seed libtorch's one global generator: one test at a time.
static GENERATOR: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn lock() -> std::sync::MutexGuard<'static, ()> {
    GENERATOR.lock().unwrap_or_else(|e| e.into_inner())
}

/// `count` successes of `n` trials with probability `q` lie within 6 standard deviations.
fn assert_binomial(what: &str, count: i64, n: i64, q: f64) {
    let (mean, sd) = (n as f64 * q, (n as f64 * q * (1.0 - q)).sqrt());
    assert!((count as f64 - mean).abs() <= 6.0 * sd, "{what}: {count} of {n}, expected {mean:.0} ± {:.0}", 6.0 * sd);
}

#[test]
fn keeps_each_element_with_probability_one_minus_p_scaled_as_libtorch() {
    let _one_at_a_time = lock();
    tch::manual_seed(1);
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half, Kind::Double] {
        // Non-zero inputs, so that a zero output means a dropped element.
        let x = (Tensor::rand([N], (Kind::Float, Device::Cpu)) + 0.5).to_kind(kind);
        for p in [0.25, 0.5, 0.1] {
            let y = dropout(&x, p, true);
            assert_eq!((y.size(), y.kind()), (x.size(), kind));
            let kept = y.ne(0.0);
            assert_binomial(&format!("{kind:?} p={p} kept"), kept.sum(Kind::Int64).int64_value(&[]), N, 1.0 - p);
            // The scale libtorch's CPU dropout applies (`noise.div_(1 - p)` on ones of the
            // dtype), bit for bit, and the output is x times it.
            let scale = Tensor::ones([1], (kind, Device::Cpu)).divide_scalar(1.0 - p);
            let expected = x.where_self(&kept, &x.zeros_like()) * &scale;
            assert!(y.equal(&expected), "{kind:?} p={p}: kept elements are not x · (1/(1 − p))");
        }
    }
}

#[test]
fn masks_are_independent_between_elements() {
    let _one_at_a_time = lock();
    tch::manual_seed(2);
    let x = Tensor::ones([N], (Kind::Float, Device::Cpu));
    for p in [0.25, 0.5] {
        let dropped = dropout(&x, p, true).eq(0.0);
        let pairs = dropped.view([N / 2, 2]);
        // Elements 2i and 2i+1 take the two halves of one random word; i and i+1 neighbouring
        // words: both dropped with probability p².
        let both_in_word = pairs.select(1, 0).logical_and(&pairs.select(1, 1)).sum(Kind::Int64).int64_value(&[]);
        assert_binomial(&format!("p={p} both halves of a word dropped"), both_in_word, N / 2, p * p);
        let odd_even = pairs.select(1, 1).narrow(0, 0, N / 2 - 1).logical_and(&pairs.select(1, 0).narrow(0, 1, N / 2 - 1));
        assert_binomial(&format!("p={p} neighbouring words"), odd_even.sum(Kind::Int64).int64_value(&[]), N / 2 - 1, p * p);
        // A second call draws a new mask: agreement with the first is chance (p² + (1 − p)²).
        let again = dropout(&x, p, true).eq(0.0);
        let agree = dropped.eq_tensor(&again).sum(Kind::Int64).int64_value(&[]);
        assert_binomial(&format!("p={p} agreement of two calls"), agree, N, p * p + (1.0 - p) * (1.0 - p));
    }
}

#[test]
fn the_mask_is_a_function_of_the_seed_alone_at_any_thread_count() {
    let _one_at_a_time = lock();
    let x = Tensor::ones([N + 1], (Kind::Float, Device::Cpu)); // odd: the last element alone
    /// Restores one intra-op thread however the test ends.
    struct OneThreadAfter;
    impl Drop for OneThreadAfter {
        fn drop(&mut self) {
            tch::set_num_threads(1);
        }
    }
    let _restore = OneThreadAfter;
    let draw = |seed: i64, threads: i32| {
        tch::set_num_threads(threads);
        tch::manual_seed(seed);
        dropout(&x, 0.25, true)
    };
    let one = draw(7, 1);
    assert!(one.equal(&draw(7, 2)), "two threads draw another mask than one");
    assert!(one.equal(&draw(7, 4)), "four threads draw another mask than one");
    assert!(!one.equal(&draw(8, 1)), "another seed draws the same mask");
}

#[test]
fn the_gradient_is_the_upstream_gradient_times_the_same_noise() {
    let _one_at_a_time = lock();
    tch::manual_seed(3);
    for kind in [Kind::Float, Kind::BFloat16] {
        for p in [0.5, 0.25] {
            let x = (Tensor::rand([4096], (Kind::Float, Device::Cpu)) + 0.5).to_kind(kind).set_requires_grad(true);
            let g = Tensor::randn([4096], (Kind::Float, Device::Cpu)).to_kind(kind);
            let y = dropout(&x, p, true);
            (&y * &g).sum(kind).backward();
            // The noise: libtorch's scale where an element was kept, 0 where it was dropped.
            let scale = Tensor::ones([1], (kind, Device::Cpu)).divide_scalar(1.0 - p);
            let noise = scale.where_self(&y.ne(0.0), &Tensor::zeros([1], (kind, Device::Cpu)));
            assert!(x.grad().equal(&(&g * &noise)), "{kind:?} p={p}: gradient is not g · noise");
            assert!(y.detach().equal(&(&x.detach() * &noise)), "{kind:?} p={p}: output is not x · noise");
        }
    }
}

#[test]
fn eval_mode_and_p_zero_are_the_identity_and_p_one_drops_everything() {
    let _one_at_a_time = lock();
    let x = Tensor::randn([1000], (Kind::Float, Device::Cpu));
    assert!(dropout(&x, 0.5, false).equal(&x));
    assert!(dropout(&x, 0.0, true).equal(&x));
    assert!(dropout(&x, 1.0, true).equal(&x.zeros_like()));
    let empty = Tensor::zeros([0, 3], (Kind::Float, Device::Cpu));
    assert_eq!(dropout(&empty, 0.5, true).size(), [0, 3]);
}

//! The core AdamW against libtorch's (tch's `nn::AdamW`): the same weights, bit for bit, so every
//! level can use the checkpointable one without changing a result; and its state round-trips.

use ladder_core::model::{BasicNet, BasicNetConfig};
use ladder_core::optim::{AdamW, AdamWConfig};
use tch::nn::{self, ModuleT, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn net(seed: i64) -> (nn::VarStore, BasicNet) {
    tch::manual_seed(seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = BasicNet::new(&vs.root(), BasicNetConfig::default());
    (vs, net)
}

/// Two nets with the same weights (copied: tests run in parallel threads and libtorch's
/// generator is global, so seeding alone could race).
fn twins(seed: i64) -> ((nn::VarStore, BasicNet), (nn::VarStore, BasicNet)) {
    let a = net(seed);
    let mut b = net(seed);
    b.0.copy(&a.0).unwrap();
    (a, b)
}

fn batch(i: i64) -> (Tensor, Tensor) {
    tch::manual_seed(1000 + i);
    (Tensor::randn([16, 1, 28, 28], (Kind::Float, Device::Cpu)), Tensor::randint(10, [16], (Kind::Int64, Device::Cpu)))
}

fn params(vs: &nn::VarStore) -> Vec<Tensor> {
    vs.trainable_variables()
}

#[test]
fn bit_identical_to_libtorch_adamw() {
    let ((vs_a, net_a), (vs_b, net_b)) = twins(7);
    let mut theirs = nn::AdamW::default().build(&vs_a, 3e-3).unwrap();
    let mut ours = AdamW::new(params(&vs_b), AdamWConfig { lr: 3e-3, ..Default::default() }).unwrap();
    for i in 0..4 {
        let (x, y) = batch(i);
        theirs.zero_grad();
        net_a.forward_t(&x, false).nll_loss(&y).backward();
        theirs.step();
        ours.zero_grad();
        net_b.forward_t(&x, false).nll_loss(&y).backward();
        ours.step();
    }
    for (a, b) in params(&vs_a).iter().zip(params(&vs_b)) {
        let diff = (a - &b).abs().max().double_value(&[]);
        assert_eq!(diff, 0.0, "parameter of shape {:?} differs by {diff}", a.size());
    }
    assert_eq!(ours.step_count(), 4);
}

#[test]
fn state_dict_resumes_exactly() {
    let names: Vec<String> = (0..8).map(|i| format!("p{i}")).collect();
    // Run A: 5 uninterrupted steps.
    let ((vs_a, net_a), (vs_b, net_b)) = twins(3);
    let mut a = AdamW::new(params(&vs_a), AdamWConfig::default()).unwrap();
    // Run B: 2 steps, state saved, a fresh optimizer loads it, 3 more steps.
    let mut b = AdamW::new(params(&vs_b), AdamWConfig::default()).unwrap();
    for i in 0..5 {
        let (x, y) = batch(i);
        a.zero_grad();
        net_a.forward_t(&x, false).nll_loss(&y).backward();
        a.step();
        if i == 2 {
            let sd = b.state_dict(&names);
            assert_eq!(sd.len(), 3 * 8);
            b = AdamW::new(params(&vs_b), AdamWConfig::default()).unwrap();
            b.load_state_dict(&names, &sd).unwrap();
            assert_eq!(b.step_count(), 2);
        }
        b.zero_grad();
        net_b.forward_t(&x, false).nll_loss(&y).backward();
        b.step();
    }
    for (pa, pb) in params(&vs_a).iter().zip(params(&vs_b)) {
        assert!(pa.equal(&pb));
    }
    // Bad state dicts name the key.
    let mut sd = b.state_dict(&names);
    sd.push(("p9.exp_avg".into(), Tensor::zeros([1], (Kind::Float, Device::Cpu))));
    let err = b.load_state_dict(&names, &sd).unwrap_err().to_string();
    assert!(err.contains("unexpected keys [\"p9.exp_avg\"]"), "{err}");
    let sd: Vec<_> = b.state_dict(&names).into_iter().filter(|(k, _)| k != "p0.step").collect();
    let err = b.load_state_dict(&names, &sd).unwrap_err().to_string();
    assert!(err.contains("parameter p0 has only part of its state"), "{err}");
}


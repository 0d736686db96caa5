//! Defects 6 and 7: the optimizers' hyperparameter checks are PyTorch's literal
//! comparisons, in PyTorch's order, with its messages, and floats in the messages read as
//! Python's `repr` prints them (`-1.0`, `1e-08`, `nan`, `inf`, `-1e+16`, `0.001`).
//!
//! `torch/optim/sgd.py` (`SGD.__init__`): `lr < 0.0`, `momentum < 0.0`,
//! `weight_decay < 0.0`, then `nesterov and (momentum <= 0 or dampening != 0)`: NaN passes
//! every `<` test. `torch/optim/adamw.py` / `adam.py` (`__init__`): `not 0.0 <= lr`,
//! `not 0.0 <= eps`, `not 0.0 <= betas[0] < 1.0`, `not 0.0 <= betas[1] < 1.0`,
//! `not 0.0 <= weight_decay`: NaN fails every one.
use super::{D0, Owned, TestResult, harness};
use ferrocuda_amp::optim::{AdamW, AdamWConfig, Param, Sgd, SgdConfig};

const NAN: f32 = f32::NAN;
const INF: f32 = f32::INFINITY;

type SgdCase = (fn(&mut SgdConfig), Option<&'static str>);

fn sgd_cases() -> Vec<SgdCase> {
    vec![
        (|c| c.lr = NAN, None),
        (|c| c.lr = INF, None),
        (|c| c.lr = -INF, Some("Invalid learning rate: -inf")),
        (|c| c.lr = -1.0, Some("Invalid learning rate: -1.0")),
        (|c| c.lr = -0.001, Some("Invalid learning rate: -0.001")),
        (|c| c.lr = -1e-8, Some("Invalid learning rate: -1e-08")),
        (|c| c.lr = -1e16, Some("Invalid learning rate: -1e+16")),
        (|c| c.lr = -0.0, None),
        (|c| c.momentum = NAN, None),
        (|c| c.momentum = INF, None),
        (|c| c.momentum = -INF, Some("Invalid momentum value: -inf")),
        (|c| c.momentum = -0.5, Some("Invalid momentum value: -0.5")),
        (|c| c.weight_decay = NAN, None),
        (|c| c.weight_decay = INF, None),
        (
            |c| c.weight_decay = -INF,
            Some("Invalid weight_decay value: -inf"),
        ),
        (
            |c| c.weight_decay = -2.0,
            Some("Invalid weight_decay value: -2.0"),
        ),
        (|c| c.dampening = NAN, None),
        (|c| c.dampening = -INF, None),
        (|c| c.dampening = -1.0, None),
        (
            |c| (c.nesterov, c.momentum) = (true, 0.0),
            Some("Nesterov momentum requires a momentum and zero dampening"),
        ),
        (
            |c| (c.nesterov, c.momentum, c.dampening) = (true, 0.9, NAN),
            Some("Nesterov momentum requires a momentum and zero dampening"),
        ),
        (|c| (c.nesterov, c.momentum) = (true, NAN), None),
        (|c| (c.nesterov, c.momentum) = (true, INF), None),
        (|c| (c.nesterov, c.momentum) = (true, 0.9), None),
        // PyTorch's order: lr, momentum, weight_decay, Nesterov.
        (
            |c| (c.lr, c.momentum, c.weight_decay) = (-1.0, -1.0, -1.0),
            Some("Invalid learning rate: -1.0"),
        ),
        (
            |c| (c.momentum, c.weight_decay) = (-1.0, -1.0),
            Some("Invalid momentum value: -1.0"),
        ),
        (
            |c| (c.nesterov, c.momentum, c.weight_decay) = (true, -1.0, -3.0),
            Some("Invalid momentum value: -1.0"),
        ),
        (
            |c| (c.nesterov, c.weight_decay) = (true, -3.0),
            Some("Invalid weight_decay value: -3.0"),
        ),
    ]
}

type AdamWCase = (fn(&mut AdamWConfig), Option<&'static str>);

fn adamw_cases() -> Vec<AdamWCase> {
    vec![
        (|c| c.lr = NAN, Some("Invalid learning rate: nan")),
        (|c| c.lr = INF, None),
        (|c| c.lr = -INF, Some("Invalid learning rate: -inf")),
        (|c| c.lr = -0.001, Some("Invalid learning rate: -0.001")),
        (|c| c.lr = 0.0, None),
        (|c| c.eps = NAN, Some("Invalid epsilon value: nan")),
        (|c| c.eps = INF, None),
        (|c| c.eps = -1e-8, Some("Invalid epsilon value: -1e-08")),
        (
            |c| c.betas.0 = NAN,
            Some("Invalid beta parameter at index 0: nan"),
        ),
        (
            |c| c.betas.0 = INF,
            Some("Invalid beta parameter at index 0: inf"),
        ),
        (
            |c| c.betas.0 = -INF,
            Some("Invalid beta parameter at index 0: -inf"),
        ),
        (
            |c| c.betas.0 = 1.0,
            Some("Invalid beta parameter at index 0: 1.0"),
        ),
        (
            |c| c.betas.0 = -0.5,
            Some("Invalid beta parameter at index 0: -0.5"),
        ),
        (|c| c.betas.0 = 0.0, None),
        (
            |c| c.betas.1 = NAN,
            Some("Invalid beta parameter at index 1: nan"),
        ),
        (
            |c| c.betas.1 = INF,
            Some("Invalid beta parameter at index 1: inf"),
        ),
        (
            |c| c.betas.1 = 1.0,
            Some("Invalid beta parameter at index 1: 1.0"),
        ),
        (
            |c| c.betas.1 = 1e20,
            Some("Invalid beta parameter at index 1: 1e+20"),
        ),
        (
            |c| c.weight_decay = NAN,
            Some("Invalid weight_decay value: nan"),
        ),
        (|c| c.weight_decay = INF, None),
        (
            |c| c.weight_decay = -0.01,
            Some("Invalid weight_decay value: -0.01"),
        ),
        // PyTorch's order: lr, eps, betas[0], betas[1], weight_decay.
        (
            |c| (c.lr, c.eps) = (NAN, NAN),
            Some("Invalid learning rate: nan"),
        ),
        (
            |c| (c.eps, c.betas.0) = (NAN, NAN),
            Some("Invalid epsilon value: nan"),
        ),
        (
            |c| c.betas = (2.0, 3.0),
            Some("Invalid beta parameter at index 0: 2.0"),
        ),
        (
            |c| (c.betas.1, c.weight_decay) = (3.0, -1.0),
            Some("Invalid beta parameter at index 1: 3.0"),
        ),
    ]
}

fn params(
    h: &ferrocuda_testkit::Harness,
) -> Result<(Owned, Vec<Param>), Box<dyn std::error::Error>> {
    let p = Owned::new(h, 3, 1.0, 0.5)?;
    let list = vec![p.param()];
    Ok((p, list))
}

#[test]
fn sgd_checks_are_pytorchs_comparisons() -> TestResult {
    let h = harness();
    let (_keep, params) = params(&h)?;
    for (i, (set, want)) in sgd_cases().into_iter().enumerate() {
        let mut config = SgdConfig::default();
        set(&mut config);
        let got = Sgd::new(&h.rt, &params, config)
            .err()
            .map(|e| e.to_string());
        assert_eq!(got.as_deref(), want, "case {i}: {config:?}");
    }
    Ok(())
}

#[test]
fn adamw_checks_are_pytorchs_comparisons() -> TestResult {
    let h = harness();
    let (_keep, params) = params(&h)?;
    for (i, (set, want)) in adamw_cases().into_iter().enumerate() {
        let mut config = AdamWConfig::default();
        set(&mut config);
        let got = AdamW::new(&h.rt, &params, config)
            .err()
            .map(|e| e.to_string());
        assert_eq!(got.as_deref(), want, "case {i}: {config:?}");
    }
    Ok(())
}

/// `set_lr` applies the constructor's learning-rate check.
#[test]
fn set_lr_checks_as_the_constructor() -> TestResult {
    let h = harness();
    let stream = h.rt.current_stream(D0)?;
    let (_keep, params) = params(&h)?;
    let mut sgd = Sgd::new(&h.rt, &params, SgdConfig::default())?;
    sgd.set_lr(&stream, NAN)?;
    assert!(sgd.config().lr.is_nan());
    let e = sgd.set_lr(&stream, -2.5).err().map(|e| e.to_string());
    assert_eq!(e.as_deref(), Some("Invalid learning rate: -2.5"));
    let mut adamw = AdamW::new(&h.rt, &params, AdamWConfig::default())?;
    let e = adamw.set_lr(&stream, NAN).err().map(|e| e.to_string());
    assert_eq!(e.as_deref(), Some("Invalid learning rate: nan"));
    Ok(())
}

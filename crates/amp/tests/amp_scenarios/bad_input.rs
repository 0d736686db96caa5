//! Bad input to the scaler and the optimizers is a typed error, never a panic or a runaway:
//! a wrong device, an integer gradient, a view whose bytes run past the end of the address
//! space (its chunk table would otherwise be built for 2^59 chunks), mismatched lengths,
//! no parameters, a NaN learning rate (AdamW's; SGD's check lets NaN through, as PyTorch's).
use ferrocuda_amp::optim::{
    AdamW, AdamWConfig, OptimError, Param, Sgd, SgdConfig, register_fake_optim_kernels,
};
use ferrocuda_amp::scaler::register_fake_amp_kernels;
use ferrocuda_amp::{GradScaler, GradScalerConfig, ScalerError, TensorView, ViewOutOfRange};
use ferrocuda_stream::{DeviceBuffer, StreamError};
use ferrocuda_testkit::fake_harness;
use ferrocuda_types::{DType, DeviceIndex, DevicePtr};

type TestResult = Result<(), Box<dyn std::error::Error>>;
const D0: DeviceIndex = DeviceIndex(0);

fn view(device: DeviceIndex, ptr: u64, len: u64, dtype: DType) -> TensorView {
    TensorView {
        device,
        ptr: DevicePtr(ptr),
        len,
        dtype,
    }
}

#[test]
fn the_scaler_refuses_bad_gradients_with_typed_errors() -> TestResult {
    let h = fake_harness();
    if let Some(fake) = &h.fake {
        register_fake_amp_kernels(fake);
    }
    assert!(matches!(
        GradScaler::new(&h.rt, DeviceIndex(7), GradScalerConfig::default()),
        Err(ScalerError::Stream(StreamError::InvalidDevice { .. }))
    ));
    let mut s = GradScaler::new(&h.rt, D0, GradScalerConfig::default())?;
    let stream = h.rt.current_stream(D0)?;
    let int = view(D0, 0x1000, 16, DType::I32);
    assert!(matches!(
        s.unscale_device(&stream, &[int]),
        Err(ScalerError::UnsupportedDtype { dtype: DType::I32 })
    ));
    let elsewhere = view(DeviceIndex(3), 0x1000, 16, DType::F32);
    assert!(matches!(
        s.unscale_device(&stream, &[elsewhere]),
        Err(ScalerError::WrongDevice { .. })
    ));
    let past_the_end = view(D0, u64::MAX - 8, u64::MAX / 2, DType::F32);
    assert_eq!(
        s.unscale_device(&stream, &[past_the_end]).err(),
        Some(ScalerError::ViewOutOfRange(ViewOutOfRange {
            ptr: past_the_end.ptr,
            len: past_the_end.len,
            dtype: DType::F32,
        }))
    );
    let huge = view(D0, 0x1000, 1 << 61, DType::F32);
    assert!(matches!(
        s.unscale_device(&stream, &[huge]),
        Err(ScalerError::TooLarge { .. })
    ));
    Ok(())
}

#[test]
fn optimizers_refuse_bad_parameters_with_typed_errors() -> TestResult {
    let h = fake_harness();
    if let Some(fake) = &h.fake {
        register_fake_optim_kernels(fake);
    }
    assert!(matches!(
        Sgd::new(&h.rt, &[], SgdConfig::default()),
        Err(OptimError::NoParameters)
    ));
    assert!(matches!(
        AdamW::new(&h.rt, &[], AdamWConfig::default()),
        Err(OptimError::NoParameters)
    ));
    let p = DeviceBuffer::<f32>::filled(&h.rt, D0, 8, 1.0)?;
    let g = DeviceBuffer::<f32>::filled(&h.rt, D0, 4, 1.0)?;
    let short = Param {
        param: TensorView::of(&p),
        grad: TensorView::of(&g),
    };
    assert!(matches!(
        Sgd::new(&h.rt, &[short], SgdConfig::default()),
        Err(OptimError::LengthMismatch { .. })
    ));
    let past_the_end = Param {
        param: view(D0, u64::MAX - 8, 8, DType::F32),
        grad: view(D0, u64::MAX - 8, 8, DType::F32),
    };
    assert!(matches!(
        Sgd::new(&h.rt, &[past_the_end], SgdConfig::default()),
        Err(OptimError::ViewOutOfRange(_))
    ));
    let fine = Param {
        param: TensorView::of(&p),
        grad: TensorView::of(&p),
    };
    // PyTorch's SGD tests `lr < 0.0`, which NaN passes; AdamW's `not 0.0 <= lr` refuses it.
    let nan = SgdConfig {
        lr: f32::NAN,
        ..SgdConfig::default()
    };
    Sgd::new(&h.rt, &[fine], nan)?;
    let nan = AdamWConfig {
        lr: f32::NAN,
        ..AdamWConfig::default()
    };
    let e = AdamW::new(&h.rt, &[fine], nan)
        .err()
        .ok_or("a NaN lr is refused")?;
    assert_eq!(e.to_string(), "Invalid learning rate: nan");
    Ok(())
}

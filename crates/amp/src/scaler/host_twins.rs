//! The host versions of [`SCALER_KERNELS`](super::kernels::SCALER_KERNELS) for the fake
//! device: the same chunk table, the same state words, the arithmetic of
//! [`super::reference`], so that a test on the fake device checks everything but the CUDA
//! C++ itself (the GPU bundle runs the same tests on it).
use super::abi::{code_dtype, word};
use super::reference::{self, GradElement, UpdateParams};
use ferrocuda_driver::{FakeDriver, KernelContext};
use ferrocuda_types::{DType, DevicePtr};
use half::{bf16, f16};

/// Registers the host twins of the scaler's kernels on a fake driver, replacing ones
/// registered before. Not needed to use a [`GradScaler`](crate::GradScaler): loading its
/// kernels on a fake device provides them.
pub fn register_fake_amp_kernels(fake: &FakeDriver) {
    fake.register_kernel("amp_check_unscale", check_unscale);
    fake.register_kernel("amp_update_scale", update_scale);
}

/// Provides the host twins on a fake driver, keeping any a test registered itself: what
/// loading the scaler's kernels on a fake device does.
pub(crate) fn provide(fake: &FakeDriver) {
    fake.provide_kernel("amp_check_unscale", check_unscale);
    fake.provide_kernel("amp_update_scale", update_scale);
}

fn check_unscale(k: &mut KernelContext<'_>) -> Result<(), String> {
    let (table, n) = (k.arg::<DevicePtr>(0)?, k.arg::<u32>(1)? as usize);
    let (found, found_all) = (k.arg::<DevicePtr>(2)?, k.arg::<DevicePtr>(3)?);
    let inv = k.read::<f32>(k.arg::<DevicePtr>(4)?, 1)?[0];
    let words = k.read::<u64>(table, 2 * n)?;
    let mut bad = false;
    for chunk in words.chunks_exact(2) {
        let (ptr, len) = (DevicePtr(chunk[0]), (chunk[1] & 0xffff_ffff) as usize);
        bad |= match code_dtype((chunk[1] >> 32) as u32) {
            DType::F32 => chunk_twin::<f32>(k, ptr, len, inv)?,
            DType::F16 => chunk_twin::<f16>(k, ptr, len, inv)?,
            DType::BF16 => chunk_twin::<bf16>(k, ptr, len, inv)?,
            _ => chunk_twin::<f64>(k, ptr, len, inv)?,
        };
    }
    if bad {
        k.write(found, &[1.0f32])?;
        k.write(found_all, &[1.0f32])?;
    }
    Ok(())
}

fn chunk_twin<T: GradElement>(
    k: &mut KernelContext<'_>,
    ptr: DevicePtr,
    len: usize,
    inv: f32,
) -> Result<bool, String> {
    let mut values = k.read::<T>(ptr, len)?;
    let bad = reference::check_and_unscale(&mut values, inv);
    if inv != 1.0 {
        k.write(ptr, &values)?;
    }
    Ok(bad)
}

fn update_scale(k: &mut KernelContext<'_>) -> Result<(), String> {
    let state = k.arg::<DevicePtr>(0)?;
    let found_inf = k.read::<f32>(k.arg::<DevicePtr>(1)?, 1)?[0];
    let clamp = k.arg::<i32>(7)?;
    let p = UpdateParams {
        growth_factor: k.arg(2)?,
        backoff_factor: k.arg(3)?,
        growth_interval: k.arg(4)?,
        min_scale: (clamp & 1 != 0).then_some(k.arg::<f32>(5)?),
        max_scale: (clamp & 2 != 0).then_some(k.arg::<f32>(6)?),
    };
    let mut w = k.read::<u32>(state, word::COUNT)?;
    let at = |i: u64| i as usize;
    let (scale, tracker) = reference::update_scale(
        f32::from_bits(w[at(word::SCALE)]),
        w[at(word::GROWTH_TRACKER)] as i32,
        found_inf,
        &p,
    );
    w[at(word::SCALE)] = scale.to_bits();
    w[at(word::INV_SCALE)] = reference::inv_scale(scale).to_bits();
    w[at(word::GROWTH_TRACKER)] = tracker as u32;
    w[at(word::UPDATES)] = w[at(word::UPDATES)].wrapping_add(1);
    let found = found_inf != 0.0;
    if found {
        w[at(word::SKIPPED)] = w[at(word::SKIPPED)].wrapping_add(1);
        w[at(word::CONSECUTIVE_SKIPPED)] = w[at(word::CONSECUTIVE_SKIPPED)].wrapping_add(1);
    } else {
        w[at(word::CONSECUTIVE_SKIPPED)] = 0;
    }
    w[at(word::LAST_SKIPPED)] = u32::from(found);
    k.write(state, &w)
}

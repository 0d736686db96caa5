//! Eligibility and cast rules: what a tensor library asks before running an op.
//!
//! The rules are PyTorch's (`is_autocast_eligible`, `cached_cast`, `prioritize` and the
//! `WrapFunction_` policies in `aten/src/ATen/autocast_mode.h`): an argument is eligible
//! for device D when it is floating point but not fp64 and lives on D (XLA tensors count for
//! CUDA). The answer is a [`CastPlan`], a small value that then tells the dtype each argument
//! must be cast to, without allocating.
use ferrocuda_types::DType;

use super::cache::thread_cached_cast;
use super::device::DeviceKind;
use super::error::AutocastError;
use super::guards::{DeviceView, device_view};
use super::policy::{CastPolicy, OpId, policy};

/// What autocast needs to know about a tensor argument. Implement it for your tensor type
/// (or a reference to it); undefined optional tensors and non-tensor arguments are simply
/// not passed.
pub trait AutocastArg {
    /// The element type.
    fn dtype(&self) -> DType;
    /// The kind of device the tensor lives on.
    fn device_kind(&self) -> DeviceKind;
    /// Whether the dtype is a floating type (fp8 types count, should a library have them).
    fn is_floating_point(&self) -> bool {
        self.dtype().is_floating_point()
    }
    /// Whether the tensor is a leaf (not a view) that requires grad: only such tensors
    /// (parameters) are kept in the weight-cast cache.
    fn is_leaf_requiring_grad(&self) -> bool;
    /// An identity no other live tensor shares and that is never reused while a cached
    /// cast may hold it (for example a storage id from a process-wide counter).
    fn identity(&self) -> u64;
    /// The version counter, bumped by every in-place write.
    fn version(&self) -> u64;
}

impl<T: AutocastArg + ?Sized> AutocastArg for &T {
    fn dtype(&self) -> DType {
        (**self).dtype()
    }
    fn device_kind(&self) -> DeviceKind {
        (**self).device_kind()
    }
    fn is_floating_point(&self) -> bool {
        (**self).is_floating_point()
    }
    fn is_leaf_requiring_grad(&self) -> bool {
        (**self).is_leaf_requiring_grad()
    }
    fn identity(&self) -> u64 {
        (**self).identity()
    }
    fn version(&self) -> u64 {
        (**self).version()
    }
}

/// Whether `arg` is autocast-eligible for `device`: floating, not fp64, on `device`.
#[inline]
pub fn is_eligible<A: AutocastArg + ?Sized>(device: DeviceKind, arg: &A) -> bool {
    arg.is_floating_point() && arg.dtype() != DType::F64 && device.accepts(arg.device_kind())
}

/// What to do with one op call.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CastPlan {
    /// Run the op with its arguments as they are (autocast off, op not listed, or the
    /// policy leaves this call alone).
    RunAsIs,
    /// Cast every eligible argument whose dtype differs to `to`; see [`CastPlan::target`].
    Cast {
        /// The device whose policy ran.
        device: DeviceKind,
        /// The dtype eligible arguments are cast to.
        to: DType,
        /// Whether fp32 parameters' casts go through the weight-cast cache.
        cacheable: bool,
    },
    /// Leave the inputs alone; if the op's optional `dtype` argument is unset, set it to
    /// `dtype` (see [`CastPlan::dtype_arg`]).
    SetOptDtype {
        /// The dtype to fill in.
        dtype: DType,
    },
    /// Call the overload `redispatch` instead, with `dtype` appended.
    AppendDtype {
        /// The dtype to append.
        dtype: DType,
        /// The overload to call.
        redispatch: &'static str,
    },
}

impl CastPlan {
    /// The dtype `arg` must be cast to, `None` to leave it alone.
    #[inline]
    pub fn target<A: AutocastArg + ?Sized>(&self, arg: &A) -> Option<DType> {
        match *self {
            CastPlan::Cast { device, to, .. } if is_eligible(device, arg) && arg.dtype() != to => {
                Some(to)
            }
            _ => None,
        }
    }

    /// [`CastPlan::target`] of each argument, in order.
    pub fn targets<'a, I>(&'a self, args: I) -> impl Iterator<Item = Option<DType>> + 'a
    where
        I: IntoIterator + 'a,
        I::Item: AutocastArg,
    {
        args.into_iter().map(move |a| self.target(&a))
    }

    /// The `dtype` argument to pass to the op, given the caller's.
    pub fn dtype_arg(&self, given: Option<DType>) -> Option<DType> {
        match *self {
            CastPlan::SetOptDtype { dtype } => given.or(Some(dtype)),
            _ => given,
        }
    }

    /// Casts `arg` if the plan says so, through this thread's weight-cast cache when the
    /// cache applies: the plan allows it (target = the region's dtype, cache on, not in
    /// inference mode) and `arg` is an fp32 leaf that requires grad. A cached cast is reused
    /// only while `arg`'s version is unchanged. `Ok(None)` = use `arg` as it is.
    ///
    /// `cast(to)` should make the cast with grad mode on, so that a cast first made under
    /// no-grad still carries autograd history when reused (PyTorch PR #165068).
    pub fn cast_arg<A, V, E>(
        &self,
        arg: &A,
        cast: impl FnOnce(DType) -> Result<V, E>,
    ) -> Result<Option<V>, E>
    where
        A: AutocastArg + ?Sized,
        V: Clone + 'static,
    {
        let Some(to) = self.target(arg) else {
            return Ok(None);
        };
        let cacheable = matches!(
            self,
            CastPlan::Cast {
                cacheable: true,
                ..
            }
        ) && arg.dtype() == DType::F32
            && arg.is_leaf_requiring_grad();
        if cacheable {
            thread_cached_cast(arg.identity(), arg.version(), to, || cast(to)).map(Some)
        } else {
            cast(to).map(Some)
        }
    }
}

/// The plan for calling `op` on `device` with tensor arguments `args` (tensor lists
/// flattened, in order), under this thread's autocast state.
///
/// Errors: the op is banned on `device` ([`AutocastError::Banned`], PyTorch's message), or a
/// promote op mixes lower-precision dtypes ([`AutocastError::MixedLowerPrecision`]).
#[inline]
pub fn cast_inputs<I>(device: DeviceKind, op: OpId, args: I) -> Result<CastPlan, AutocastError>
where
    I: IntoIterator,
    I::Item: AutocastArg,
{
    let view = device_view(device);
    if !view.enabled {
        return Ok(CastPlan::RunAsIs);
    }
    match policy(device, op) {
        None => Ok(CastPlan::RunAsIs),
        Some(p) => plan(device, op, p, view, args),
    }
}

/// [`cast_inputs`] by op name (`op` or `op.overload`); unknown names run as they are.
pub fn cast_inputs_by_name<I>(
    device: DeviceKind,
    op: &str,
    args: I,
) -> Result<CastPlan, AutocastError>
where
    I: IntoIterator,
    I::Item: AutocastArg,
{
    match OpId::resolve(op) {
        Some(id) => cast_inputs(device, id, args),
        None => Ok(CastPlan::RunAsIs),
    }
}

fn plan<I>(
    device: DeviceKind,
    op: OpId,
    policy: CastPolicy,
    view: DeviceView,
    args: I,
) -> Result<CastPlan, AutocastError>
where
    I: IntoIterator,
    I::Item: AutocastArg,
{
    let cast = |to: DType| CastPlan::Cast {
        device,
        to,
        cacheable: view.cache_usable && to == view.dtype,
    };
    let mut args = args.into_iter();
    Ok(match policy {
        CastPolicy::LowerPrecision => cast(view.dtype),
        CastPolicy::Fp32 => cast(DType::F32),
        CastPolicy::CudnnRnnFp16 => cast(DType::F16),
        CastPolicy::Promote => cast(promote(device, op, view.dtype, args)?),
        CastPolicy::Fp32SetOptDtype => match args.next() {
            Some(first) if is_eligible(device, &first) => {
                CastPlan::SetOptDtype { dtype: DType::F32 }
            }
            _ => CastPlan::RunAsIs,
        },
        CastPolicy::Fp32AppendDtype { redispatch } => match args.next() {
            Some(first) => CastPlan::AppendDtype {
                dtype: if is_eligible(device, &first) {
                    DType::F32
                } else {
                    first.dtype()
                },
                redispatch,
            },
            None => CastPlan::RunAsIs,
        },
        CastPolicy::Banned { message } => {
            return Err(AutocastError::Banned {
                op: op.name(),
                message,
            });
        }
    })
}

/// PyTorch's `prioritize` fold, in argument order: start from the region's dtype; fp64 and
/// ineligible tensors are skipped; any fp32 makes the result fp32 from then on; a
/// lower-precision dtype other than the region's is an error while the result is not fp32.
fn promote<I>(device: DeviceKind, op: OpId, lower: DType, args: I) -> Result<DType, AutocastError>
where
    I: Iterator,
    I::Item: AutocastArg,
{
    let mut current = lower;
    for arg in args {
        if !is_eligible(device, &arg) {
            continue;
        }
        let next = arg.dtype();
        if current == DType::F32 || next == DType::F32 {
            current = DType::F32;
        } else if next != lower {
            return Err(AutocastError::MixedLowerPrecision {
                op: op.name(),
                device,
                autocast_dtype: lower,
                found: next,
            });
        }
    }
    Ok(current)
}

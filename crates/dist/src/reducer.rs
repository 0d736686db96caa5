//! DDP's bucketed gradient all-reduce (torch/csrc/distributed/c10d/reducer.cpp and
//! `compute_bucket_assignment_by_size`): parameters are put into buckets in reverse order
//! (gradients arrive from the last layer first), the first bucket capped at 1 MiB and the
//! others at 25 MiB by default; a gradient is copied into its bucket on the current stream
//! when it is ready (`mark_variable_ready`), and a bucket is all-reduced as soon as it is
//! full and every bucket before it has been launched, on the group's communication stream,
//! overlapping the rest of the backward pass. [`Reducer::finish`] makes the current stream
//! wait for every bucket and copies the results back (`finalize_backward`): no host sync.
use crate::{DistError, ProcessGroup, Result, Work};
use ferrocuda_driver::nccl::ReduceOp;
use ferrocuda_stream::{DeviceBuffer, Runtime};
use ferrocuda_types::DevicePtr;
use std::sync::Arc;

/// DDP's bucket caps (`bucket_cap_mb`, `_DEFAULT_FIRST_BUCKET_BYTES`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BucketCaps {
    /// The cap of the first bucket (default 1 MiB).
    pub first_bytes: u64,
    /// The cap of every other bucket (default 25 MiB).
    pub bytes: u64,
}

impl Default for BucketCaps {
    fn default() -> Self {
        BucketCaps {
            first_bytes: 1 << 20,
            bytes: 25 << 20,
        }
    }
}

#[derive(Debug)]
struct Bucket {
    /// Parameters in the bucket, in the order they were put in.
    params: Vec<usize>,
    flat: DeviceBuffer<f32>,
    pending: usize,
    work: Option<Work>,
}

/// One rank's bucketed all-reduce of `f32` gradients.
#[derive(Debug)]
pub struct Reducer {
    runtime: Arc<Runtime>,
    group: Arc<ProcessGroup>,
    op: ReduceOp,
    buckets: Vec<Bucket>,
    /// Per parameter: its bucket, its offset there (elements), its length, whether ready.
    slots: Vec<(usize, usize, usize, bool)>,
    next_launch: usize,
    launched: Vec<usize>,
}

/// `compute_bucket_assignment_by_size` for one dtype and device: parameters taken in
/// reverse order, a bucket closed once it holds at least its cap.
pub fn assign_buckets(param_lens: &[usize], caps: BucketCaps) -> Vec<Vec<usize>> {
    let mut buckets = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut bytes = 0u64;
    for p in (0..param_lens.len()).rev() {
        current.push(p);
        bytes += (param_lens[p] * size_of::<f32>()) as u64;
        let cap = if buckets.is_empty() {
            caps.first_bytes
        } else {
            caps.bytes
        };
        if bytes >= cap {
            buckets.push(std::mem::take(&mut current));
            bytes = 0;
        }
    }
    if !current.is_empty() {
        buckets.push(current);
    }
    buckets
}

impl Reducer {
    /// A reducer for parameters of `param_lens` elements, reducing with `op` (DDP divides by
    /// the world size and sums: [`ReduceOp::Avg`]; [`ReduceOp::Sum`] for the plain sum).
    pub fn new(
        runtime: Arc<Runtime>,
        group: Arc<ProcessGroup>,
        param_lens: &[usize],
        caps: BucketCaps,
        op: ReduceOp,
    ) -> Result<Reducer> {
        let mut slots = vec![(0, 0, 0, false); param_lens.len()];
        let mut buckets = Vec::new();
        for (b, params) in assign_buckets(param_lens, caps).into_iter().enumerate() {
            let mut offset = 0;
            for &p in &params {
                slots[p] = (b, offset, param_lens[p], false);
                offset += param_lens[p];
            }
            buckets.push(Bucket {
                pending: params.len(),
                params,
                flat: DeviceBuffer::filled(&runtime, group.device(), offset, 0.0)?,
                work: None,
            });
        }
        Ok(Reducer {
            runtime,
            group,
            op,
            buckets,
            slots,
            next_launch: 0,
            launched: Vec::new(),
        })
    }

    /// The parameters of each bucket.
    pub fn buckets(&self) -> Vec<Vec<usize>> {
        self.buckets.iter().map(|b| b.params.clone()).collect()
    }

    /// The buckets launched so far this iteration, in launch order.
    pub fn launched(&self) -> &[usize] {
        &self.launched
    }

    /// The gradient of `param` is ready (`autograd_hook` → `mark_variable_ready`): copied
    /// into its bucket on the current stream; full buckets are launched in order.
    pub fn grad_ready(&mut self, param: usize, grad: &DeviceBuffer<f32>) -> Result<()> {
        let Some(&(b, offset, len, ready)) = self.slots.get(param) else {
            return Err(DistError::Reducer(format!("no parameter {param}")));
        };
        if ready {
            return Err(DistError::Reducer(format!(
                "Expected to mark a variable ready only once (parameter {param})"
            )));
        }
        self.check_gradient(grad, len)?;
        let dst = bucket_ptr(&self.buckets[b].flat, offset);
        copy(&self.runtime, self.group.device(), dst, grad.ptr(), len)?;
        self.slots[param].3 = true;
        self.buckets[b].pending -= 1;
        while let Some(next) = self.buckets.get_mut(self.next_launch) {
            if next.pending > 0 {
                break;
            }
            next.work = Some(self.group.all_reduce(&next.flat, self.op)?);
            self.launched.push(self.next_launch);
            self.next_launch += 1;
        }
        Ok(())
    }

    /// Ends the iteration (`finalize_backward`): the current stream waits for every
    /// bucket, and the reduced values are copied back into `grads` (indexed by parameter).
    /// Every gradient must have been marked ready.
    pub fn finish(&mut self, grads: &[&DeviceBuffer<f32>]) -> Result<()> {
        if self.next_launch < self.buckets.len() || grads.len() != self.slots.len() {
            return Err(DistError::Reducer(
                "Expected to have finished reduction in the prior iteration before starting \
                 a new one: not every gradient was marked ready"
                    .into(),
            ));
        }
        for (slot, grad) in self.slots.iter().zip(grads) {
            self.check_gradient(grad, slot.2)?;
        }
        for bucket in &mut self.buckets {
            if let Some(work) = bucket.work.take() {
                work.wait()?;
            }
            bucket.pending = bucket.params.len();
        }
        for (p, slot) in self.slots.iter_mut().enumerate() {
            let (b, offset, len, _) = *slot;
            let dst = grads[p];
            let src = bucket_ptr(&self.buckets[b].flat, offset);
            copy(&self.runtime, self.group.device(), dst.ptr(), src, len)?;
            slot.3 = false;
        }
        self.next_launch = 0;
        self.launched.clear();
        Ok(())
    }

    /// A gradient must live on the group's device (the bucket copies are same-device copies
    /// on its current stream) and have its parameter's length.
    fn check_gradient(&self, grad: &DeviceBuffer<f32>, len: usize) -> Result<()> {
        if grad.device() != self.group.device() {
            return Err(DistError::DeviceMismatch {
                expected: self.group.device(),
                found: grad.device(),
            });
        }
        if grad.len() != len {
            return Err(DistError::LengthMismatch {
                what: "gradient",
                expected: len,
                found: grad.len(),
            });
        }
        Ok(())
    }
}

fn bucket_ptr(flat: &DeviceBuffer<f32>, offset: usize) -> DevicePtr {
    DevicePtr(flat.ptr().0 + (offset * size_of::<f32>()) as u64)
}

/// `len` floats from `src` to `dst` on `dev`'s current stream.
fn copy(
    runtime: &Runtime,
    dev: ferrocuda_types::DeviceIndex,
    dst: DevicePtr,
    src: DevicePtr,
    len: usize,
) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let stream = runtime.current_stream(dev)?;
    Ok(runtime.driver().memcpy_dtod_async(
        dst,
        src,
        (len * size_of::<f32>()) as u64,
        stream.handle(),
    )?)
}

/// The gradient scaler's `found_inf` reduced across ranks (maximum), without a host
/// synchronisation: the current stream waits for the all-reduce.
pub fn reduce_found_inf(group: &ProcessGroup, found_inf: &DeviceBuffer<f32>) -> Result<()> {
    group.all_reduce(found_inf, ReduceOp::Max)?.wait()
}

use ferrocuda::Backend;
use ferrocuda::alloc::{Caching, DeviceAllocators};
use ferrocuda::stream::DeviceBuffer;
use ferrocuda::types::{AllocatorConfig, DeviceIndex, EventFlags};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The fake device: a real backend kept in host memory (no GPU, no CUDA toolkit).
    let rt = Backend::Fake.runtime();
    // PyTorch's caching allocator, configured with a PYTORCH_CUDA_ALLOC_CONF string.
    let config = AllocatorConfig::parse("expandable_segments:True")?;
    let allocators = DeviceAllocators::new(rt.driver().clone(), config, Caching::On);
    allocators.install(&rt); // every DeviceBuffer of `rt` now allocates through it
    let dev = DeviceIndex(0);

    let x = DeviceBuffer::from_slice(&rt, dev, &[1.0f32, 2.0, 3.0])?;
    let side = rt.stream_from_pool(dev, false)?; // torch.cuda.Stream()
    side.wait_stream(&rt.current_stream(dev)?)?;
    x.record_stream(&side)?; // its block is not reused before `side` gets past this point
    let done = rt.new_event(EventFlags::default())?;
    done.record(&side)?;
    done.synchronize()?;
    assert_eq!(x.to_host()?, [1.0, 2.0, 3.0]);
    drop(x);

    let stats = allocators.device(dev)?.stats(); // torch.cuda.memory_stats(0)
    print!("{}", stats.summary(0, false)); // torch.cuda.memory_summary(0)
    Ok(())
}

//! What a function's warm-up asked of the tree's pool, kept so that its recording can be
//! planned before it runs ([`Trees::plan`](super::Trees::plan)).
use super::tensor::{Input, Shape};
use ferrocuda_alloc::CaptureRequests;

/// What a function's warm-up asked of the pool, and the copies its recording will add.
#[derive(Clone, Debug)]
pub(crate) struct WarmedUp {
    /// The function's own requests (not the padded inputs' copies).
    requests: CaptureRequests,
    /// Bytes of each copy a recording that starts a step makes: one per non-static input
    /// (at its padded shape), none of zero bytes.
    copies: Vec<u64>,
}

impl WarmedUp {
    pub(crate) fn new(requests: CaptureRequests, inputs: &[Input<'_>], shapes: &[Shape]) -> Self {
        let copies = (inputs.iter().zip(shapes))
            .filter(|(input, _)| !input.is_static)
            .map(|(input, shape)| shape.bytes(input.dtype))
            .filter(|&bytes| bytes > 0)
            .collect();
        WarmedUp { requests, copies }
    }

    /// The requests of a recording that starts a step, on the stream with key `stream`:
    /// the input copies, the function's requests, the copies freed.
    pub(crate) fn recording(&self, stream: u64) -> CaptureRequests {
        let mut r = CaptureRequests::new();
        let copies: Vec<usize> = self.copies.iter().map(|&b| r.alloc(b, stream)).collect();
        r.append(&self.requests);
        copies.into_iter().for_each(|c| r.free(c));
        r
    }
}

//! Where the fake device's streams run: work enqueued in stream order (or recorded into a
//! capture), completed at once or when a test advances it, and drained when the host
//! blocks (a synchronize, a free).
use super::work::{Node, Work, execute};
use super::{Completion, FakeEvent, Recorded, State, StreamKey};
use crate::DriverError;
use ferrocuda_types::DeviceIndex;
use std::time::Instant;

impl State {
    /// Enqueues work on a stream, or records it as a graph node if the stream is capturing.
    pub(super) fn enqueue(&mut self, key: StreamKey, work: Work) -> Result<(), DriverError> {
        let stream = self
            .streams
            .get_mut(&key)
            .ok_or(DriverError::INVALID_HANDLE)?;
        if let Some(link) = stream.capture.as_mut() {
            let cap = self
                .captures
                .get_mut(&link.id)
                .ok_or(DriverError::STREAM_CAPTURE_INVALIDATED)?;
            if cap.invalidated {
                return Err(DriverError::STREAM_CAPTURE_INVALIDATED);
            }
            cap.nodes.push(Node {
                work,
                deps: std::mem::take(&mut link.deps),
            });
            link.deps = vec![cap.nodes.len() - 1];
            return Ok(());
        }
        self.wait_implicitly(key)?;
        let stream = self
            .streams
            .get_mut(&key)
            .ok_or(DriverError::INVALID_HANDLE)?;
        stream.queue.push_back(work);
        stream.enqueued += 1;
        self.busy.set_queued(key, true);
        if self.completion == Completion::Eager {
            self.run(key, None, usize::MAX, false);
        }
        Ok(())
    }

    /// Queues on `key` the implicit waits that work enqueued on it next makes (see
    /// [`State::implicit_waits`]): for `enqueue`, and for a copy the driver enqueues and
    /// then waits for (`memcpy_dtoh`).
    pub(super) fn wait_implicitly(&mut self, key: StreamKey) -> Result<(), DriverError> {
        let device = self
            .streams
            .get(&key)
            .ok_or(DriverError::INVALID_HANDLE)?
            .device;
        let implicit = self.implicit_waits(key, device)?;
        if implicit.is_empty() {
            return Ok(());
        }
        let stream = self
            .streams
            .get_mut(&key)
            .ok_or(DriverError::INVALID_HANDLE)?;
        for wait in implicit {
            stream.queue.push_back(wait);
            stream.enqueued += 1;
        }
        self.busy.set_queued(key, true);
        Ok(())
    }

    /// The legacy stream and blocking streams wait for each other's earlier work. Legacy
    /// work while a blocking stream of the device is capturing breaks that capture (906).
    pub(super) fn implicit_waits(
        &mut self,
        key: StreamKey,
        device: DeviceIndex,
    ) -> Result<Vec<Work>, DriverError> {
        let legacy = (device.0, 0);
        let is_legacy = key == legacy;
        if !is_legacy && self.streams.get(&key).is_some_and(|s| s.flags.non_blocking) {
            return Ok(Vec::new());
        }
        if is_legacy {
            self.refuse_legacy_beside_blocking_captures(device)?;
        }
        // Only a stream with work queued can be waited for: the legacy stream waits for the
        // device's busy streams, a blocking stream for the legacy stream.
        let candidates = if is_legacy {
            self.busy.queued_on(device.0)
        } else {
            vec![legacy]
        };
        self.busy.visited(candidates.len());
        Ok(candidates
            .into_iter()
            .filter_map(|k| self.streams.get(&k).map(|s| (k, s)))
            .filter(|(k, s)| {
                *k != key
                    && k.0 == device.0
                    && s.enqueued > s.completed
                    && if is_legacy {
                        !s.flags.non_blocking
                    } else {
                        k.1 == 0
                    }
            })
            .map(|(k, s)| Work::Wait {
                stream: k,
                seq: s.enqueued,
            })
            .collect())
    }

    /// The captures that blocking streams of `device` are recording: the legacy stream
    /// cannot be used (nor asked whether it captures) while there is one.
    pub(super) fn blocking_captures_on(&mut self, device: DeviceIndex) -> Vec<u64> {
        let capturing = self.busy.capturing_on(device.0);
        self.busy.visited(capturing.len());
        capturing
            .into_iter()
            .filter_map(|k| self.streams.get(&k).map(|s| (k, s)))
            .filter(|(k, s)| k.0 == device.0 && !s.flags.non_blocking && k.1 != 0)
            .filter_map(|(_, s)| s.capture.as_ref().map(|l| l.id))
            .collect()
    }

    /// Work, a query or a synchronization of the legacy stream while blocking streams of
    /// its device capture: refused with 906, and those captures are invalidated (seen on an
    /// H200 in every capture mode: docs/measurements/h200_2026-12-01g/legacy_probe.py).
    pub(super) fn refuse_legacy_beside_blocking_captures(
        &mut self,
        device: DeviceIndex,
    ) -> Result<(), DriverError> {
        let broken = self.blocking_captures_on(device);
        if broken.is_empty() {
            return Ok(());
        }
        self.refuse_breaking(DriverError::STREAM_CAPTURE_IMPLICIT, |id, _| {
            broken.contains(&id)
        })
    }

    pub(super) fn is_done(&self, stream: StreamKey, seq: u64) -> bool {
        self.streams.get(&stream).is_none_or(|s| s.completed >= seq)
    }

    /// Completes work on `key` in order until `until` items are done (all if `None`) or
    /// `budget` items ran. A wait on incomplete work stops the run unless `force`, which
    /// first completes the awaited stream (as a GPU would, eventually).
    pub(super) fn run(
        &mut self,
        key: StreamKey,
        until: Option<u64>,
        mut budget: usize,
        force: bool,
    ) -> usize {
        self.busy.visited(1);
        let mut done = 0;
        while budget > 0 {
            let Some(stream) = self.streams.get_mut(&key) else {
                break;
            };
            if until.is_some_and(|u| stream.completed >= u) {
                break;
            }
            let Some(front) = stream.queue.front() else {
                break;
            };
            if let Work::Wait { stream: other, seq } = *front
                && !self.is_done(other, seq)
            {
                if !force || other == key {
                    break;
                }
                self.run(other, Some(seq), usize::MAX, true);
                if !self.is_done(other, seq) {
                    break;
                }
            }
            let Some(stream) = self.streams.get_mut(&key) else {
                break;
            };
            let Some(work) = stream.queue.pop_front() else {
                break;
            };
            let device = stream.device;
            stream.completed += 1;
            if stream.queue.is_empty() {
                self.busy.set_queued(key, false);
            }
            self.complete(&work, device);
            done += 1;
            budget -= 1;
        }
        done
    }

    pub(super) fn complete(&mut self, work: &Work, device: DeviceIndex) {
        if let Work::Record { event, generation } = work {
            if let Some(FakeEvent {
                recorded:
                    Recorded::Stream {
                        generation: g, at, ..
                    },
                ..
            }) = self.events.get_mut(event)
                && g == generation
            {
                *at = Some(Instant::now());
            }
            return;
        }
        if let Err(e) = execute(work, &mut self.memory, &mut self.hosts)
            && let Some(slot) = self.sticky.get_mut(device.as_usize())
        {
            slot.get_or_insert(e);
        }
    }

    /// Completes everything on `key` (a host-blocking wait).
    pub(super) fn drain(&mut self, key: StreamKey) -> Result<(), DriverError> {
        self.run(key, None, usize::MAX, true);
        let s = self.streams.get(&key).ok_or(DriverError::INVALID_HANDLE)?;
        match self.sticky.get(s.device.as_usize()).copied().flatten() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    pub(super) fn drain_device(&mut self, dev: DeviceIndex) -> Result<(), DriverError> {
        // A stream with nothing queued has nothing to run: visit only the busy ones.
        for k in self.busy.queued_on(dev.0) {
            self.run(k, None, usize::MAX, true);
        }
        match self.sticky.get(dev.as_usize()).copied().flatten() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    pub(super) fn event_done(&self, ev: &FakeEvent) -> bool {
        match ev.recorded {
            Recorded::Nowhere => true,
            Recorded::Stream { stream, seq, .. } => self.is_done(stream, seq),
            Recorded::Captured { .. } => false,
        }
    }
}

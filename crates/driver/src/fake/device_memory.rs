//! Fake device memory: address space per device, physical chunks backed by host pages only
//! once written, and mappings from addresses to chunks (the virtual-memory API's model; a
//! plain `malloc` is a chunk mapped at a fresh address).
use crate::DriverError;
use crate::fake::addresses::{
    AddressPlan, DEVICE_SPAN_BITS, PLAN_REGION, PlanCursor, PlanUse, device_of, span_start,
};
use ferrocuda_types::{DeviceIndex, DevicePtr};
use std::collections::{BTreeMap, HashMap};

/// Host page size used to back touched device memory.
const PAGE: u64 = 64 * 1024;
/// Allocation and mapping granularity, as on H100/H200.
pub(crate) const GRANULARITY: u64 = 2 << 20;

struct Chunk {
    device: DeviceIndex,
    bytes: u64,
    pages: HashMap<u64, Box<[u8]>>,
    mappings: u32,
    /// Whether the handle `cuMemCreate` gave was released (a `cuMemAlloc` chunk: at once).
    released: bool,
    /// Handles imported from it ([`Memory::alias_chunk`]) not yet released.
    aliases: u32,
}

struct Mapping {
    len: u64,
    chunk: u64,
    accessible: bool,
    /// Devices (bit `d`) other than the owner that may access it: all for `cuMemAlloc`
    /// memory (peer access is the context's), those given `cuMemSetAccess` for a mapping.
    peers: u64,
}

struct DeviceSpace {
    capacity: u64,
    used: u64,
    next_va: u64,
    mappings: BTreeMap<u64, Mapping>,
    reservations: BTreeMap<u64, u64>,
    mallocs: HashMap<u64, u64>,
    /// Address mode: where the next `malloc`s go.
    plan: Option<PlanCursor>,
}

/// All fake device memory of one [`FakeDriver`](crate::FakeDriver).
pub(crate) struct Memory {
    devices: Vec<DeviceSpace>,
    chunks: HashMap<u64, Chunk>,
    /// Imported handles (`cuMemImportFromShareableHandle`): the chunk each names.
    aliases: HashMap<u64, u64>,
    next_chunk: u64,
    backing: bool,
}

/// The bit of `peer` in [`Mapping::peers`] (the fake models peers among 64 devices).
fn peer_bit(peer: DeviceIndex) -> Result<u64, DriverError> {
    1u64.checked_shl(u32::from(peer.0))
        .ok_or(DriverError::INVALID_DEVICE)
}

fn round_up(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

impl Memory {
    pub(crate) fn new(devices: usize, capacity: u64, backing: bool) -> Memory {
        let devices = (0..devices as u64)
            .map(|d| DeviceSpace {
                capacity,
                used: 0,
                next_va: (d + 1) << DEVICE_SPAN_BITS,
                mappings: BTreeMap::new(),
                reservations: BTreeMap::new(),
                mallocs: HashMap::new(),
                plan: None,
            })
            .collect();
        Memory {
            devices,
            chunks: HashMap::new(),
            aliases: HashMap::new(),
            next_chunk: 1,
            backing,
        }
    }

    fn space(&mut self, dev: DeviceIndex) -> Result<&mut DeviceSpace, DriverError> {
        self.devices
            .get_mut(dev.as_usize())
            .ok_or(DriverError::INVALID_DEVICE)
    }

    pub(crate) fn info(&self, dev: DeviceIndex) -> Result<(u64, u64), DriverError> {
        let s = self
            .devices
            .get(dev.as_usize())
            .ok_or(DriverError::INVALID_DEVICE)?;
        Ok((s.capacity.saturating_sub(s.used), s.capacity))
    }

    pub(crate) fn capacity(&self, dev: DeviceIndex) -> u64 {
        self.devices.get(dev.as_usize()).map_or(0, |s| s.capacity)
    }

    /// Puts device `dev` in address mode (before anything was allocated on it): `malloc`s
    /// follow `plan`, fresh addresses and reservations come from above the planned region.
    /// A device the memory does not have is left alone.
    pub(crate) fn set_plan(&mut self, dev: DeviceIndex, plan: &AddressPlan) {
        if let Some(space) = self.devices.get_mut(dev.as_usize()) {
            space.plan = Some(PlanCursor::new(plan, dev));
            space.next_va = space.next_va.max(span_start(dev) + PLAN_REGION);
        }
    }

    /// How device `dev`'s `malloc`s used its plan (`None` without one).
    pub(crate) fn plan_use(&self, dev: DeviceIndex) -> Option<PlanUse> {
        self.devices
            .get(dev.as_usize())
            .and_then(|s| s.plan.as_ref())
            .map(PlanCursor::used)
    }

    /// Fresh addresses of the device's span (never reused); out of memory once the span is
    /// used up, as the driver reports an exhausted address space.
    fn take_va(space: &mut DeviceSpace, bytes: u64, align: u64) -> Result<DevicePtr, DriverError> {
        let base = round_up(space.next_va, align);
        let end = base.checked_add(round_up(bytes.max(1), align));
        let span_end = ((space.next_va >> DEVICE_SPAN_BITS) + 1) << DEVICE_SPAN_BITS;
        match end {
            Some(end) if end <= span_end => {
                space.next_va = end;
                Ok(DevicePtr(base))
            }
            _ => Err(DriverError::OUT_OF_MEMORY),
        }
    }

    /// Physical memory for the virtual-memory API (`cuMemCreate`).
    pub(crate) fn create_chunk(
        &mut self,
        dev: DeviceIndex,
        bytes: u64,
    ) -> Result<u64, DriverError> {
        let space = self.space(dev)?;
        if bytes == 0 {
            return Err(DriverError::INVALID_VALUE);
        }
        let accounted = round_up(bytes, GRANULARITY);
        if space.used + accounted > space.capacity {
            return Err(DriverError::OUT_OF_MEMORY);
        }
        space.used += accounted;
        let id = self.next_chunk;
        self.next_chunk += 1;
        self.chunks.insert(
            id,
            Chunk {
                device: dev,
                bytes,
                pages: HashMap::new(),
                mappings: 0,
                released: false,
                aliases: 0,
            },
        );
        Ok(id)
    }

    pub(crate) fn chunk_device(&self, handle: u64) -> Option<DeviceIndex> {
        self.live_chunk(handle).map(|(_, c)| c.device)
    }

    /// The chunk a live handle names (one `cuMemCreate` gave, or an import of it).
    fn live_chunk(&self, handle: u64) -> Option<(u64, &Chunk)> {
        match self.aliases.get(&handle) {
            Some(&chunk) => self.chunks.get(&chunk).map(|c| (chunk, c)),
            None => self
                .chunks
                .get(&handle)
                .filter(|c| !c.released)
                .map(|c| (handle, c)),
        }
    }

    fn drop_chunk_if_unused(&mut self, chunk: u64) {
        let Some(c) = self.chunks.get(&chunk) else {
            return;
        };
        if c.released && c.mappings == 0 && c.aliases == 0 {
            let (dev, bytes) = (c.device, round_up(c.bytes, GRANULARITY));
            self.chunks.remove(&chunk);
            if let Some(s) = self.devices.get_mut(dev.as_usize()) {
                s.used -= bytes;
            }
        }
    }

    pub(crate) fn release_chunk(&mut self, handle: u64) -> Result<(), DriverError> {
        let chunk = match self.aliases.remove(&handle) {
            Some(chunk) => {
                if let Some(c) = self.chunks.get_mut(&chunk) {
                    c.aliases -= 1;
                }
                chunk
            }
            None => {
                let c = self.chunks.get_mut(&handle).filter(|c| !c.released);
                c.ok_or(DriverError::INVALID_HANDLE)?.released = true;
                handle
            }
        };
        self.drop_chunk_if_unused(chunk);
        Ok(())
    }

    /// A second handle of the chunk `handle` names, as an import of its exported
    /// descriptor gives: the chunk lives until every handle and mapping is gone.
    pub(crate) fn alias_chunk(&mut self, handle: u64) -> Result<u64, DriverError> {
        let (chunk, _) = self.live_chunk(handle).ok_or(DriverError::INVALID_HANDLE)?;
        let alias = self.next_chunk;
        self.next_chunk += 1;
        self.aliases.insert(alias, chunk);
        if let Some(c) = self.chunks.get_mut(&chunk) {
            c.aliases += 1;
        }
        Ok(alias)
    }

    /// The bytes of the chunk a live handle names.
    pub(crate) fn chunk_bytes(&self, handle: u64) -> Option<u64> {
        self.live_chunk(handle).map(|(_, c)| c.bytes)
    }

    /// The chunk under `dev`'s `cuMemAlloc` allocation starting at `ptr`.
    pub(crate) fn malloc_chunk(&self, dev: DeviceIndex, ptr: DevicePtr) -> Option<u64> {
        let space = self.devices.get(dev.as_usize())?;
        space.mallocs.get(&ptr.0).copied()
    }

    /// Maps the chunk `chunk` (live or not, as long as something holds it) once more, at a
    /// fresh address of `dev`, accessible to every device: what opening another process's
    /// allocation (`cuIpcOpenMemHandle`) gives. It holds the chunk until
    /// [`Memory::unmap_shared`].
    pub(crate) fn map_shared(
        &mut self,
        dev: DeviceIndex,
        chunk: u64,
    ) -> Result<DevicePtr, DriverError> {
        let c = self.chunks.get(&chunk).ok_or(DriverError::INVALID_VALUE)?;
        let len = round_up(c.bytes, GRANULARITY);
        let at = Self::take_va(self.space(dev)?, len, GRANULARITY)?;
        self.map_for_every_device(dev, at, len, chunk)?;
        Ok(at)
    }

    /// Maps `chunk` at `at` of `dev`, accessible to every device (peer access for memory of
    /// `cuMemAlloc` and of opened IPC handles is the contexts'), holding the chunk.
    fn map_for_every_device(
        &mut self,
        dev: DeviceIndex,
        at: DevicePtr,
        len: u64,
        chunk: u64,
    ) -> Result<(), DriverError> {
        let mapping = Mapping {
            len,
            chunk,
            accessible: true,
            peers: u64::MAX,
        };
        self.space(dev)?.mappings.insert(at.0, mapping);
        if let Some(c) = self.chunks.get_mut(&chunk) {
            c.mappings += 1;
        }
        Ok(())
    }

    /// Removes a mapping [`Memory::map_shared`] made (`cuIpcCloseMemHandle`).
    pub(crate) fn unmap_shared(
        &mut self,
        dev: DeviceIndex,
        at: DevicePtr,
    ) -> Result<(), DriverError> {
        let space = self.space(dev)?;
        let m = space
            .mappings
            .remove(&at.0)
            .ok_or(DriverError::INVALID_VALUE)?;
        if let Some(c) = self.chunks.get_mut(&m.chunk) {
            c.mappings -= 1;
        }
        self.drop_chunk_if_unused(m.chunk);
        Ok(())
    }

    pub(crate) fn reserve(
        &mut self,
        dev: DeviceIndex,
        bytes: u64,
    ) -> Result<DevicePtr, DriverError> {
        let space = self.space(dev)?;
        if bytes == 0 || !bytes.is_multiple_of(GRANULARITY) {
            return Err(DriverError::INVALID_VALUE);
        }
        let base = Self::take_va(space, bytes, GRANULARITY)?;
        space.reservations.insert(base.0, bytes);
        Ok(base)
    }

    pub(crate) fn unreserve(
        &mut self,
        dev: DeviceIndex,
        base: DevicePtr,
        bytes: u64,
    ) -> Result<(), DriverError> {
        let space = self.space(dev)?;
        if space.reservations.get(&base.0) != Some(&bytes) {
            return Err(DriverError::INVALID_VALUE);
        }
        if space
            .mappings
            .range(base.0..base.0 + bytes)
            .next()
            .is_some()
        {
            return Err(DriverError::INVALID_VALUE);
        }
        space.reservations.remove(&base.0);
        Ok(())
    }

    /// Maps the whole chunk at `at`, which must lie inside a reservation and overlap nothing.
    pub(crate) fn map(
        &mut self,
        at: DevicePtr,
        chunk: u64,
        accessible: bool,
    ) -> Result<(), DriverError> {
        let dev = device_of(at).ok_or(DriverError::INVALID_VALUE)?;
        let live = self.live_chunk(chunk).filter(|(_, c)| c.device == dev);
        let (chunk, c) = live.ok_or(DriverError::INVALID_HANDLE)?;
        let len = c.bytes;
        let space = self.space(dev)?;
        if !at.0.is_multiple_of(GRANULARITY) || len % GRANULARITY != 0 {
            return Err(DriverError::INVALID_VALUE);
        }
        let inside = space
            .reservations
            .range(..=at.0)
            .next_back()
            .is_some_and(|(&b, &l)| at.0 + len <= b + l);
        if !inside || Self::overlaps(&space.mappings, at.0, len) {
            return Err(DriverError::INVALID_VALUE);
        }
        space.mappings.insert(
            at.0,
            Mapping {
                len,
                chunk,
                accessible,
                peers: 0,
            },
        );
        if let Some(c) = self.chunks.get_mut(&chunk) {
            c.mappings += 1;
        }
        Ok(())
    }

    fn overlaps(mappings: &BTreeMap<u64, Mapping>, start: u64, len: u64) -> bool {
        let before = mappings.range(..start).next_back();
        before.is_some_and(|(&s, m)| s + m.len > start)
            || mappings.range(start..start + len).next().is_some()
    }

    /// The mappings that exactly tile `[at, at + bytes)`, or an error.
    fn tiling(space: &DeviceSpace, at: u64, bytes: u64) -> Result<Vec<u64>, DriverError> {
        let mut starts = Vec::new();
        let mut cursor = at;
        for (&s, m) in space.mappings.range(at..at + bytes) {
            if s != cursor {
                return Err(DriverError::INVALID_VALUE);
            }
            starts.push(s);
            cursor = s + m.len;
        }
        if cursor != at + bytes || bytes == 0 {
            return Err(DriverError::INVALID_VALUE);
        }
        Ok(starts)
    }

    pub(crate) fn set_access(&mut self, at: DevicePtr, bytes: u64) -> Result<(), DriverError> {
        let dev = device_of(at).ok_or(DriverError::INVALID_VALUE)?;
        let space = self.space(dev)?;
        for s in Self::tiling(space, at.0, bytes)? {
            if let Some(m) = space.mappings.get_mut(&s) {
                m.accessible = true;
            }
        }
        Ok(())
    }

    /// `cuMemSetAccess` for `peer`, a device other than the memory's.
    pub(crate) fn set_peer_access(
        &mut self,
        at: DevicePtr,
        bytes: u64,
        peer: DeviceIndex,
    ) -> Result<(), DriverError> {
        let dev = device_of(at).ok_or(DriverError::INVALID_VALUE)?;
        let space = self.space(dev)?;
        let bit = peer_bit(peer)?;
        for s in Self::tiling(space, at.0, bytes)? {
            if let Some(m) = space.mappings.get_mut(&s) {
                m.peers |= bit;
            }
        }
        Ok(())
    }

    /// Whether `peer` may access all of `[ptr, ptr + len)` (mapped memory of another device).
    pub(crate) fn peer_accessible(&self, ptr: DevicePtr, len: u64, peer: DeviceIndex) -> bool {
        let (Some(dev), Ok(bit)) = (device_of(ptr), peer_bit(peer)) else {
            return false;
        };
        let Some(space) = self.devices.get(dev.as_usize()) else {
            return false;
        };
        let (mut at, end) = (ptr.0, ptr.0 + len);
        while at < end {
            match space.mappings.range(..=at).next_back() {
                Some((&s, m)) if at < s + m.len && m.peers & bit != 0 => at = s + m.len,
                _ => return false,
            }
        }
        true
    }

    pub(crate) fn unmap(&mut self, at: DevicePtr, bytes: u64) -> Result<(), DriverError> {
        let dev = device_of(at).ok_or(DriverError::INVALID_VALUE)?;
        let space = self.space(dev)?;
        let starts = Self::tiling(space, at.0, bytes)?;
        let chunks: Vec<u64> = starts
            .iter()
            .filter_map(|s| space.mappings.remove(s))
            .map(|m| m.chunk)
            .collect();
        for chunk in chunks {
            if let Some(c) = self.chunks.get_mut(&chunk) {
                c.mappings -= 1;
            }
            self.drop_chunk_if_unused(chunk);
        }
        Ok(())
    }

    /// `cuMemAlloc`: a chunk mapped at a fresh 512-byte aligned address.
    pub(crate) fn malloc(
        &mut self,
        dev: DeviceIndex,
        bytes: u64,
    ) -> Result<DevicePtr, DriverError> {
        let chunk = self.create_chunk(dev, bytes)?;
        let space = self.space(dev)?;
        let len = round_up(bytes, GRANULARITY);
        let planned = match space.plan.as_mut() {
            // Reservations lie above the planned region: only mappings can be in the way.
            Some(plan) => plan.take(len, |at, len| Self::overlaps(&space.mappings, at, len)),
            None => Ok(None),
        };
        let at = match planned.and_then(|p| match p {
            Some(at) => Ok(DevicePtr(at)),
            None => Self::take_va(space, len, GRANULARITY),
        }) {
            Ok(at) => at,
            Err(e) => {
                self.release_chunk(chunk)?;
                return Err(e);
            }
        };
        self.map_for_every_device(dev, at, len, chunk)?;
        self.space(dev)?.mallocs.insert(at.0, chunk);
        if let Some(c) = self.chunks.get_mut(&chunk) {
            c.released = true;
        }
        Ok(at)
    }

    pub(crate) fn free(&mut self, dev: DeviceIndex, ptr: DevicePtr) -> Result<(), DriverError> {
        let space = self.space(dev)?;
        let chunk = space
            .mallocs
            .remove(&ptr.0)
            .ok_or(DriverError::INVALID_VALUE)?;
        space.mappings.remove(&ptr.0);
        if let Some(c) = self.chunks.get_mut(&chunk) {
            // Other processes' views of it (`map_shared`) keep it.
            c.mappings -= 1;
        }
        self.drop_chunk_if_unused(chunk);
        Ok(())
    }

    /// Splits `[ptr, ptr + len)` into `(chunk, offset, len)` pieces, or `ILLEGAL_ADDRESS`.
    fn pieces(&self, ptr: DevicePtr, len: u64) -> Result<Vec<(u64, u64, u64)>, DriverError> {
        let dev = device_of(ptr).ok_or(DriverError::ILLEGAL_ADDRESS)?;
        let space = self
            .devices
            .get(dev.as_usize())
            .ok_or(DriverError::ILLEGAL_ADDRESS)?;
        let mut out = Vec::new();
        let (mut at, end) = (ptr.0, ptr.0 + len);
        while at < end {
            let (&start, m) = space
                .mappings
                .range(..=at)
                .next_back()
                .ok_or(DriverError::ILLEGAL_ADDRESS)?;
            if at >= start + m.len || !m.accessible {
                return Err(DriverError::ILLEGAL_ADDRESS);
            }
            let chunk_len = self.chunks.get(&m.chunk).map_or(0, |c| c.bytes);
            let offset = at - start;
            if offset >= chunk_len {
                return Err(DriverError::ILLEGAL_ADDRESS);
            }
            let take = (end - at).min(chunk_len - offset).min(start + m.len - at);
            out.push((m.chunk, offset, take));
            at += take;
        }
        Ok(out)
    }

    /// Whether `[ptr, ptr + len)` is mapped, accessible memory.
    pub(crate) fn check(&self, ptr: DevicePtr, len: u64) -> Result<(), DriverError> {
        self.pieces(ptr, len).map(|_| ())
    }

    pub(crate) fn read(&self, ptr: DevicePtr, dst: &mut [u8]) -> Result<(), DriverError> {
        let mut done = 0usize;
        for (chunk, offset, len) in self.pieces(ptr, dst.len() as u64)? {
            let pages = self.chunks.get(&chunk).map(|c| &c.pages);
            let (mut o, end) = (offset, offset + len);
            while o < end {
                let (page, within) = (o / PAGE, (o % PAGE) as usize);
                let n = ((PAGE - within as u64).min(end - o)) as usize;
                let out = &mut dst[done..done + n];
                match pages.and_then(|p| p.get(&page)) {
                    Some(bytes) => out.copy_from_slice(&bytes[within..within + n]),
                    None => out.fill(0),
                }
                done += n;
                o += n as u64;
            }
        }
        Ok(())
    }

    /// Writes `len` bytes produced by `byte_at(i)` for `i` in `0..len`.
    fn write_with(
        &mut self,
        ptr: DevicePtr,
        len: u64,
        byte_at: impl Fn(u64) -> u8,
    ) -> Result<(), DriverError> {
        let pieces = self.pieces(ptr, len)?;
        if !self.backing {
            return Ok(());
        }
        let mut done = 0u64;
        for (chunk, offset, len) in pieces {
            let Some(c) = self.chunks.get_mut(&chunk) else {
                continue;
            };
            let (mut o, end) = (offset, offset + len);
            while o < end {
                let (page, within) = (o / PAGE, o % PAGE);
                let n = (PAGE - within).min(end - o);
                let bytes = c
                    .pages
                    .entry(page)
                    .or_insert_with(|| vec![0u8; PAGE as usize].into());
                for k in 0..n {
                    bytes[(within + k) as usize] = byte_at(done + k);
                }
                done += n;
                o += n;
            }
        }
        Ok(())
    }

    pub(crate) fn write(&mut self, ptr: DevicePtr, src: &[u8]) -> Result<(), DriverError> {
        self.write_with(ptr, src.len() as u64, |i| src[i as usize])
    }

    pub(crate) fn fill(
        &mut self,
        ptr: DevicePtr,
        pattern: &[u8],
        count: u64,
    ) -> Result<(), DriverError> {
        let width = pattern.len() as u64;
        self.write_with(ptr, width * count, |i| pattern[(i % width) as usize])
    }

    /// Host bytes currently backing device memory (for tests of lazy backing).
    pub(crate) fn backed_bytes(&self) -> u64 {
        self.chunks
            .values()
            .map(|c| c.pages.len() as u64 * PAGE)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn untouched_memory_costs_no_host_pages() {
        let mut m = Memory::new(1, 80 << 30, true);
        let p = m.malloc(DeviceIndex(0), 60 << 30).unwrap_or_default();
        assert_eq!(m.backed_bytes(), 0);
        assert!(m.write(p.offset(5 << 30), &[7; 10]).is_ok());
        assert_eq!(m.backed_bytes(), PAGE);
        let mut back = [0u8; 12];
        assert!(m.read(p.offset((5 << 30) - 1), &mut back).is_ok());
        assert_eq!(back, [0, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 0]);
    }

    #[test]
    fn capacity_and_addresses() {
        let mut m = Memory::new(2, 8 << 20, true);
        let a = m.malloc(DeviceIndex(1), 6 << 20);
        assert!(a.is_ok_and(|p| device_of(p) == Some(DeviceIndex(1))));
        assert_eq!(
            m.malloc(DeviceIndex(1), 4 << 20),
            Err(DriverError::OUT_OF_MEMORY)
        );
        assert_eq!(m.info(DeviceIndex(1)), Ok((2 << 20, 8 << 20)));
        assert_eq!(
            m.malloc(DeviceIndex(2), 1),
            Err(DriverError::INVALID_DEVICE)
        );
    }
}

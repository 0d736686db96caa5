//! Address mode: the fake device's `malloc` hands out a recorded list of addresses in order
//! (what a real driver gave PyTorch), so a differential test or a replay sees the same
//! address order and best-fit ties break as they did.
//!
//! A real address (`0x7f9e39e00000`) lies outside the fake device's own address span, so the
//! whole list is moved by one constant: the lowest address, rounded down to 2 MiB, lands on
//! the start of the device's span. Order, distances and alignment to 2 MiB are kept.
//! Planned addresses take the span's first [`PLAN_REGION`] bytes; fresh addresses and
//! virtual-memory reservations come from above it.
use crate::DriverError;
use ferrocuda_types::{DeviceIndex, DevicePtr};

/// Address-space bits per device: device `d` owns `[(d+1) << 44, (d+2) << 44)`.
pub(crate) const DEVICE_SPAN_BITS: u32 = 44;

/// The first address of device `dev`'s span.
pub(crate) fn span_start(dev: DeviceIndex) -> u64 {
    (u64::from(dev.0) + 1) << DEVICE_SPAN_BITS
}

pub(crate) fn device_of(ptr: DevicePtr) -> Option<DeviceIndex> {
    let slot = ptr.0 >> DEVICE_SPAN_BITS;
    slot.checked_sub(1)
        .and_then(|d| u16::try_from(d).ok())
        .map(DeviceIndex)
}

/// Bytes at the start of a device's address span kept for planned addresses (8 TiB).
pub const PLAN_REGION: u64 = 1 << 43;
/// Every `cudaMalloc` address is a multiple of this.
const ALIGN: u64 = 512;
/// Planned addresses keep their offset within this (the driver's allocation granularity).
const KEEP: u64 = 2 << 20;

/// What `malloc` does when the plan has no usable address: the list is exhausted, or its
/// next address would overlap memory that is still allocated (the program diverged from
/// the recording, e.g. a replay under another configuration).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum WhenUnusable {
    /// `malloc` fails with [`DriverError::ADDRESS_PLAN_EXHAUSTED`] or
    /// [`DriverError::ADDRESS_PLAN_CONFLICT`] and the entry stays: for differential tests,
    /// where any divergence must show.
    Fail,
    /// `malloc` takes a fresh address above every planned one; a conflicting entry is
    /// skipped, so later entries still go to the same-numbered `malloc`: for replays.
    Fresh,
}

/// A list of addresses for a fake device's successful `malloc`s, in order. A real address
/// lies outside the fake device's span, so the whole list is moved by one constant: the
/// lowest address, rounded down to 2 MiB, lands on the span's start (order, distances and
/// alignment to 2 MiB are kept; [`device_address`](Self::device_address) says where one
/// lands). Give it to [`FakeDriverBuilder::address_plan`](crate::FakeDriverBuilder::address_plan).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AddressPlan {
    recorded: Vec<u64>,
    /// The lowest address rounded down to [`KEEP`]: it maps to the start of the span.
    low: u64,
    when_unusable: WhenUnusable,
}

/// Why a list of addresses cannot be a plan.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AddressPlanError {
    /// An address that no `cudaMalloc` returns.
    #[error("address {address:#x} (entry {index}) is not a multiple of 512 bytes")]
    Unaligned {
        /// Its position in the list.
        index: usize,
        /// The address.
        address: u64,
    },
    /// The addresses are too far apart for the fake device's span.
    #[error(
        "the addresses run from {low:#x} to {high:#x}; a plan may span at most {PLAN_REGION} bytes"
    )]
    TooWide {
        /// The lowest address.
        low: u64,
        /// The highest address.
        high: u64,
    },
}

impl AddressPlan {
    /// A plan handing out `recorded` in order; `when_unusable` says what follows.
    pub fn new(recorded: Vec<u64>, when_unusable: WhenUnusable) -> Result<Self, AddressPlanError> {
        if let Some((index, &address)) = recorded
            .iter()
            .enumerate()
            .find(|(_, a)| !a.is_multiple_of(ALIGN))
        {
            return Err(AddressPlanError::Unaligned { index, address });
        }
        let low = recorded.iter().min().copied().unwrap_or(0);
        let high = recorded.iter().max().copied().unwrap_or(0);
        if high - low / KEEP * KEEP >= PLAN_REGION {
            return Err(AddressPlanError::TooWide { low, high });
        }
        Ok(AddressPlan {
            recorded,
            low: low / KEEP * KEEP,
            when_unusable,
        })
    }

    /// Number of addresses.
    pub fn len(&self) -> usize {
        self.recorded.len()
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.recorded.is_empty()
    }

    /// Where the fake device `dev` places the recorded address `recorded` (which should be
    /// one of the plan's): moved by the plan's constant into the device's span.
    pub fn device_address(&self, dev: DeviceIndex, recorded: u64) -> DevicePtr {
        DevicePtr(
            span_start(dev)
                .wrapping_add(recorded)
                .wrapping_sub(self.low),
        )
    }
}

/// How a device's `malloc`s used its plan so far.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct PlanUse {
    /// `malloc`s that got their planned address.
    pub planned: usize,
    /// `malloc`s that got a fresh address (plan exhausted or its entry unusable).
    pub fresh: usize,
    /// Addresses in the plan.
    pub len: usize,
}

/// A plan being consumed by one device's `malloc`s.
#[derive(Debug)]
pub(crate) struct PlanCursor {
    /// The planned addresses, already moved into the device's span.
    addresses: Vec<u64>,
    next: usize,
    region_end: u64,
    when_unusable: WhenUnusable,
    used: PlanUse,
}

impl PlanCursor {
    pub(crate) fn new(plan: &AddressPlan, dev: DeviceIndex) -> PlanCursor {
        PlanCursor {
            addresses: plan
                .recorded
                .iter()
                .map(|&a| plan.device_address(dev, a).0)
                .collect(),
            next: 0,
            region_end: span_start(dev) + PLAN_REGION,
            when_unusable: plan.when_unusable,
            used: PlanUse {
                len: plan.recorded.len(),
                ..PlanUse::default()
            },
        }
    }

    /// The address for the next successful `malloc` of `len` bytes: `Some` planned address,
    /// `None` for a fresh one, or the plan's error. `overlaps(at, len)` says whether the
    /// range is taken.
    pub(crate) fn take(
        &mut self,
        len: u64,
        overlaps: impl Fn(u64, u64) -> bool,
    ) -> Result<Option<u64>, DriverError> {
        let fail = self.when_unusable == WhenUnusable::Fail;
        let Some(&at) = self.addresses.get(self.next) else {
            if fail {
                return Err(DriverError::ADDRESS_PLAN_EXHAUSTED);
            }
            self.used.fresh += 1;
            return Ok(None);
        };
        let fits = at
            .checked_add(len)
            .is_some_and(|end| end <= self.region_end);
        if !fits || overlaps(at, len) {
            if fail {
                return Err(DriverError::ADDRESS_PLAN_CONFLICT);
            }
            self.next += 1;
            self.used.fresh += 1;
            return Ok(None);
        }
        self.next += 1;
        self.used.planned += 1;
        Ok(Some(at))
    }

    pub(crate) fn used(&self) -> PlanUse {
        self.used
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_lists_are_refused_with_the_culprit() {
        assert_eq!(
            AddressPlan::new(vec![0x7f00_0000_0000, 0x7f00_0000_0100], WhenUnusable::Fail),
            Err(AddressPlanError::Unaligned {
                index: 1,
                address: 0x7f00_0000_0100
            })
        );
        let wide = AddressPlan::new(vec![1 << 20, (1 << 20) + PLAN_REGION], WhenUnusable::Fresh);
        assert!(matches!(wide, Err(AddressPlanError::TooWide { .. })));
        let text = wide.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            text.contains("0x100000") && text.contains("8796093022208"),
            "{text}"
        );
        assert!(AddressPlan::new(Vec::new(), WhenUnusable::Fail).is_ok_and(|p| p.is_empty()));
    }

    #[test]
    fn addresses_move_by_one_constant_keeping_order_and_alignment() -> Result<(), AddressPlanError>
    {
        let plan = AddressPlan::new(
            vec![0x7f9e_3e80_0000, 0x7f9e_39e0_0200, 0x7f9e_3ea0_0000],
            WhenUnusable::Fail,
        )?;
        let dev = DeviceIndex(1);
        let moved: Vec<u64> = [0x7f9e_3e80_0000, 0x7f9e_39e0_0200, 0x7f9e_3ea0_0000]
            .iter()
            .map(|&a| plan.device_address(dev, a).0)
            .collect();
        assert_eq!(moved[1], super::span_start(dev) + 0x200);
        assert_eq!(moved[0] - moved[1], 0x7f9e_3e80_0000 - 0x7f9e_39e0_0200);
        assert!(moved[2] > moved[0]);
        Ok(())
    }

    #[test]
    fn a_cursor_fails_or_falls_back_as_told() -> Result<(), AddressPlanError> {
        let plan = |when| AddressPlan::new(vec![0x4000_0000, 0x4020_0000], when);
        let dev = DeviceIndex(0);
        let mut strict = PlanCursor::new(&plan(WhenUnusable::Fail)?, dev);
        let base = super::span_start(dev);
        assert_eq!(strict.take(2 << 20, |_, _| false), Ok(Some(base)));
        assert_eq!(
            strict.take(2 << 20, |_, _| true),
            Err(DriverError::ADDRESS_PLAN_CONFLICT)
        );
        assert_eq!(
            strict.take(2 << 20, |_, _| false),
            Ok(Some(base + (2 << 20)))
        );
        assert_eq!(
            strict.take(2 << 20, |_, _| false),
            Err(DriverError::ADDRESS_PLAN_EXHAUSTED)
        );
        let mut lenient = PlanCursor::new(&plan(WhenUnusable::Fresh)?, dev);
        assert_eq!(lenient.take(2 << 20, |_, _| true), Ok(None));
        assert_eq!(lenient.take(PLAN_REGION, |_, _| false), Ok(None));
        assert_eq!(lenient.take(2 << 20, |_, _| false), Ok(None));
        assert_eq!(
            lenient.used(),
            PlanUse {
                planned: 0,
                fresh: 3,
                len: 2
            }
        );
        Ok(())
    }

    #[test]
    fn a_fake_device_in_address_mode_mallocs_at_the_recorded_places() -> Result<(), DriverError> {
        use crate::{Driver, FakeDriver};
        let recorded = vec![0x7f00_0060_0000, 0x7f00_0000_0000, 0x7f00_0060_0000];
        let plan = AddressPlan::new(recorded.clone(), WhenUnusable::Fail)
            .map_err(|_| DriverError::INVALID_VALUE)?;
        let dev = DeviceIndex(0);
        let fake = FakeDriver::builder()
            .capacity(64 << 20)
            .address_plan(dev, plan.clone())
            .build();
        let a = fake.malloc(dev, 2 << 20)?;
        assert_eq!(a, plan.device_address(dev, recorded[0]));
        // Out of memory: no address is taken from the plan.
        assert_eq!(fake.malloc(dev, 80 << 20), Err(DriverError::OUT_OF_MEMORY));
        let b = fake.malloc(dev, 6 << 20)?;
        assert_eq!(b, plan.device_address(dev, recorded[1]));
        // The third address is the first one again: taken while the first is allocated.
        assert_eq!(
            fake.malloc(dev, 2 << 20),
            Err(DriverError::ADDRESS_PLAN_CONFLICT)
        );
        fake.free(dev, a)?;
        assert_eq!(fake.malloc(dev, 2 << 20), Ok(a));
        assert_eq!(
            fake.malloc(dev, 2 << 20),
            Err(DriverError::ADDRESS_PLAN_EXHAUSTED)
        );
        let range = fake.vm_reserve(dev, 4 << 20)?;
        assert!(range.base.0 >= super::span_start(dev) + PLAN_REGION);
        assert_eq!(
            fake.address_plan_use(dev),
            Some(PlanUse {
                planned: 3,
                fresh: 0,
                len: 3
            })
        );
        assert_eq!(fake.address_plan_use(DeviceIndex(1)), None);
        Ok(())
    }

    #[test]
    fn a_lenient_plan_goes_on_with_fresh_addresses_above_the_planned_ones()
    -> Result<(), DriverError> {
        use crate::{Driver, FakeDriver};
        let plan = AddressPlan::new(vec![0x7f00_0000_0000], WhenUnusable::Fresh)
            .map_err(|_| DriverError::INVALID_VALUE)?;
        let dev = DeviceIndex(0);
        let fake = FakeDriver::builder().address_plan(dev, plan).build();
        let a = fake.malloc(dev, 2 << 20)?;
        let b = fake.malloc(dev, 2 << 20)?;
        assert!(b.0 >= a.0 + PLAN_REGION);
        assert_eq!(
            fake.address_plan_use(dev),
            Some(PlanUse {
                planned: 1,
                fresh: 1,
                len: 1
            })
        );
        Ok(())
    }
}

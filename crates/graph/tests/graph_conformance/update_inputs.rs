//! `update_inputs` and `update_input_ptrs`: repointing a captured graph at new buffers,
//! typed and by raw address.
use crate::{D0, N, Setup, TestResult};
use ferrocuda_driver::{Call, DriverError, FakeDriver, fake::Completion};
use ferrocuda_graph::{CaptureMode, GraphError, InputMove, InputUpdate};
use ferrocuda_stream::{DeviceBuffer, KernelCache, Runtime, Stream, StreamError};
use ferrocuda_testkit::{Harness, register_fake_kernels};
use ferrocuda_types::{DeviceIndex, DevicePtr, KernelArg, LaunchConfig, MemsetValue};
use std::ops::Range;
use std::sync::Arc;

const D1: DeviceIndex = DeviceIndex(1);

/// `update_inputs` repoints a captured graph at other buffers without copying: replays
/// then read the new inputs, untouched arguments stay, and the old buffers are unused.
pub(crate) fn update_inputs_patches_pointers(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let g = s.graph()?;
    let (x, other) = (s.buffer(1.0)?, s.buffer(0.0)?);
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    let y = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&stream, &y, &x, 2.0)?;
    s.add_one(&stream, &other)?;
    capture.end()?;
    g.replay(&stream)?;
    s.expect(&stream, &y, 2.0, "before the update")?;
    let (x2, y2) = (s.buffer(21.0)?, s.buffer(0.0)?);
    s.h.rt.current_stream(D0)?.synchronize()?;
    assert_eq!(
        g.update_inputs(&[(&x, &x2), (&y, &y2)])?,
        InputUpdate::InPlace { pointers: 2 }
    );
    x.copy_from_host(&vec![-1.0; N])?;
    s.h.rt.current_stream(D0)?.synchronize()?;
    g.replay(&stream)?;
    s.expect(&stream, &y2, 42.0, "the replay reads x2 and writes y2")?;
    s.expect(&stream, &y, 2.0, "the old output is no longer written")?;
    s.expect(&stream, &other, 2.0, "the unpatched node still runs")?;
    assert!(matches!(
        g.update_inputs(&[(&x2, &s.buffer(0.0)?)]),
        Ok(InputUpdate::InPlace { pointers: 1 })
    ));
    let short = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, 1)?;
    assert!(matches!(
        g.update_inputs(&[(&x2, &short)]),
        Err(GraphError::Stream(_))
    ));
    let empty = s.graph()?;
    assert_eq!(
        empty.update_inputs(&[(&x, &x2)]),
        Err(GraphError::NothingCaptured)
    );
    Ok(())
}

/// The move of one whole buffer, by address.
fn whole(old: &DeviceBuffer<f32>, new: &DeviceBuffer<f32>) -> InputMove {
    InputMove {
        old: old.ptr(),
        bytes: old.bytes(),
        new: new.ptr(),
    }
}

/// `update_input_ptrs` is `update_inputs` by raw address: it repoints there and back, a
/// move of a range the graph does not hold changes nothing, and a range at 0 or past the
/// end of the address space is refused as a typed error, changing nothing.
pub(crate) fn update_input_ptrs_repoints_by_address(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let g = s.graph()?;
    let x = s.buffer(1.0)?;
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    let y = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&stream, &y, &x, 2.0)?;
    capture.end()?;
    let (x2, y2) = (s.buffer(21.0)?, s.buffer(0.0)?);
    s.h.rt.current_stream(D0)?.synchronize()?;
    let there = [whole(&x, &x2), whole(&y, &y2)];
    assert_eq!(
        g.update_input_ptrs(&there)?,
        InputUpdate::InPlace { pointers: 2 }
    );
    g.replay(&stream)?;
    s.expect(&stream, &y2, 42.0, "the replay reads x2 and writes y2")?;
    let back = [whole(&x2, &x), whole(&y2, &y)];
    assert_eq!(
        g.update_input_ptrs(&back)?,
        InputUpdate::InPlace { pointers: 2 }
    );
    assert_eq!(
        g.update_input_ptrs(&[whole(&x2, &y2)])?,
        InputUpdate::InPlace { pointers: 0 },
        "the graph no longer holds x2"
    );
    let bytes = x.bytes();
    let bad = [
        InputMove {
            old: x.ptr(),
            bytes,
            new: DevicePtr(0),
        },
        InputMove {
            old: x.ptr(),
            bytes,
            new: DevicePtr(u64::MAX - bytes / 2),
        },
        InputMove {
            old: DevicePtr(0),
            bytes,
            new: x2.ptr(),
        },
    ];
    for m in bad {
        assert_eq!(
            g.update_input_ptrs(&[whole(&y, &y2), m]),
            Err(GraphError::InputRange {
                old: m.old,
                new: m.new,
                bytes
            }),
            "{m:?}"
        );
    }
    x.copy_from_host(&vec![5.0; N])?;
    s.h.rt.current_stream(D0)?.synchronize()?;
    g.replay(&stream)?;
    s.expect(
        &stream,
        &y,
        10.0,
        "back on x and y; the refusals changed nothing",
    )?;
    s.expect(&stream, &y2, 42.0, "y2 is no longer written")?;
    assert_eq!(
        s.graph()?.update_input_ptrs(&there),
        Err(GraphError::NothingCaptured)
    );
    Ok(())
}

/// When the driver refuses to set a node in the instance, and then to update the instance
/// whole from the captured graph, `update_inputs` instantiates the patched graph again
/// (fake device: the refusals are injected).
#[test]
fn update_inputs_reinstantiates_when_refused() -> TestResult {
    let h = ferrocuda_testkit::fake_harness();
    let fake = h.fake.clone().ok_or("the fake harness has a fake driver")?;
    let s = Setup::new(&h)?;
    let g = s.graph()?;
    let (x, x2) = (s.buffer(1.0)?, s.buffer(4.0)?);
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    let y = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&stream, &y, &x, 2.0)?;
    capture.end()?;
    let instantiated = fake.calls(Call::GraphInstantiate);
    for call in [Call::GraphExecSetNodes, Call::GraphExecUpdate] {
        fake.fail_nth(call, 1, DriverError::GRAPH_EXEC_UPDATE_FAILURE);
    }
    s.h.rt.current_stream(D0)?.synchronize()?;
    assert_eq!(
        g.update_inputs(&[(&x, &x2)])?,
        InputUpdate::Reinstantiated { pointers: 1 }
    );
    assert_eq!(fake.calls(Call::GraphInstantiate), instantiated + 1);
    g.replay(&stream)?;
    s.expect(&stream, &y, 8.0, "the new instance reads x2")
}

/// The graph's nodes are read from the driver once, at the first update: later updates,
/// there and back, read none, an update that moves nothing makes no driver call, and each
/// replay reads the buffers of the latest update (fake device: the driver's calls counted).
#[test]
fn update_inputs_reads_the_nodes_once() -> TestResult {
    let h = ferrocuda_testkit::fake_harness();
    let fake = h.fake.clone().ok_or("the fake harness has a fake driver")?;
    let s = Setup::new(&h)?;
    let g = s.graph()?;
    let (x, x2, other) = (s.buffer(1.0)?, s.buffer(4.0)?, s.buffer(9.0)?);
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    let y = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&stream, &y, &x, 2.0)?;
    capture.end()?;
    s.h.rt.current_stream(D0)?.synchronize()?;
    let reads = fake.calls(Call::GraphNodes);
    for (i, (old, new)) in [(&x, &x2), (&x2, &x), (&x, &x2)].into_iter().enumerate() {
        assert_eq!(
            g.update_inputs(&[(old, new)])?,
            InputUpdate::InPlace { pointers: 1 }
        );
        assert_eq!(fake.calls(Call::GraphNodes), reads + 1, "update {i}");
        g.replay(&stream)?;
        let expected = if i % 2 == 0 { 8.0 } else { 2.0 };
        s.expect(&stream, &y, expected, &format!("update {i}"))?;
    }
    let (sets, updates) = (
        fake.calls(Call::GraphSetNode),
        fake.calls(Call::GraphExecUpdate),
    );
    assert_eq!(
        g.update_inputs(&[(&other, &x)])?,
        InputUpdate::InPlace { pointers: 0 },
        "the graph does not hold `other`"
    );
    assert_eq!(
        (
            fake.calls(Call::GraphNodes),
            fake.calls(Call::GraphSetNode),
            fake.calls(Call::GraphExecUpdate)
        ),
        (reads + 1, sets, updates),
        "nothing moved: no driver call"
    );
    Ok(())
}

/// Checks `buf` after `stream`'s work: each `(range, value)` holds `value` throughout.
fn expect_parts(
    stream: &Stream,
    buf: &DeviceBuffer<f32>,
    parts: &[(Range<usize>, f32)],
    what: &str,
) -> TestResult {
    stream.synchronize()?;
    let values = buf.to_host()?;
    for (range, expected) in parts {
        if let Some(i) = range.clone().find(|&i| values[i] != *expected) {
            return Err(
                format!("{what}: element {i} is {}, expected {expected}", values[i]).into(),
            );
        }
    }
    Ok(())
}

/// The audit's case: `x.fill(0)`, `add_one(x)`, `y.copy_from(&x)` captured. Repointing `x`
/// must reach the memset and the copy as well as the kernel; then `x`'s old block, handed to
/// `z`, is no longer written by a replay.
pub(crate) fn update_inputs_repoints_memset_and_memcpy(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let g = s.graph()?;
    let x = s.buffer(5.0)?;
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    x.fill(0.0)?;
    s.add_one(&stream, &x)?;
    let y = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    y.copy_from(&x)?;
    capture.end()?;
    let x2 = s.buffer(5.0)?;
    s.h.rt.current_stream(D0)?.synchronize()?;
    let update = g.update_inputs(&[(&x, &x2)])?;
    let x_address = x.ptr();
    drop(x);
    let z = s.buffer(9.0)?;
    assert_eq!(z.ptr(), x_address, "z takes x's old block");
    s.h.rt.current_stream(D0)?.synchronize()?;
    g.replay(&stream)?;
    s.expect(
        &stream,
        &z,
        9.0,
        "z (x's old block) is not written by the replay",
    )?;
    s.expect(&stream, &x2, 1.0, "x2 is filled with 0, then incremented")?;
    s.expect(&stream, &y, 1.0, "y copies x2")?;
    assert_eq!(
        update,
        InputUpdate::InPlace { pointers: 3 },
        "the memset's destination, the kernel's argument and the copy's source"
    );
    Ok(())
}

/// Pointers into the middle of an input (`x + offset`) in a kernel argument, a memset's
/// destination and a copy's source move with it, keeping their offset.
pub(crate) fn update_inputs_repoints_interior_pointers(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let g = s.graph()?;
    let x = s.buffer(1.0)?;
    let half = N / 2;
    let at = |buf: &DeviceBuffer<f32>, i: usize| buf.ptr().offset((i * size_of::<f32>()) as u64);
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    let driver = s.h.rt.driver();
    driver.memset_async(
        at(&x, 8),
        MemsetValue::U32(0f32.to_bits()),
        8,
        stream.handle(),
    )?;
    let n = half as u32;
    let args = [
        KernelArg::Ptr {
            device: D0,
            ptr: at(&x, half),
        },
        KernelArg::value(&n),
    ];
    stream.launch(&s.add_one, &LaunchConfig::for_elements(half, 256), &args)?;
    let y = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    driver.memcpy_dtod_async(y.ptr(), at(&x, half), (half * 4) as u64, stream.handle())?;
    capture.end()?;
    let x2 = s.buffer(3.0)?;
    s.h.rt.current_stream(D0)?.synchronize()?;
    assert_eq!(
        g.update_inputs(&[(&x, &x2)])?,
        InputUpdate::InPlace { pointers: 3 },
        "three pointers into x"
    );
    g.replay(&stream)?;
    let parts = [(0..8, 3.0), (8..16, 0.0), (16..half, 3.0), (half..N, 4.0)];
    expect_parts(&stream, &x2, &parts, "x2 at the same offsets")?;
    expect_parts(&stream, &y, &[(0..half, 4.0)], "y copies x2's upper half")?;
    expect_parts(&stream, &x, &[(0..N, 1.0)], "x is no longer touched")
}

/// A node that covers part of an input and memory outside it cannot be repointed: the
/// update is refused, naming the node, and changes nothing.
pub(crate) fn update_inputs_refuses_a_node_it_cannot_repoint(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let g = s.graph()?;
    let (x, w) = (s.buffer(1.0)?, s.buffer(1.0)?);
    assert_eq!(w.ptr(), x.ptr().offset(x.bytes()), "w follows x");
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    s.add_one(&stream, &x)?;
    let (value, count) = (MemsetValue::U32(7f32.to_bits()), 2 * N as u64);
    s.h.rt
        .driver()
        .memset_async(x.ptr(), value, count, stream.handle())?;
    capture.end()?;
    let x2 = s.buffer(0.0)?;
    s.h.rt.current_stream(D0)?.synchronize()?;
    let err = g.update_inputs(&[(&x, &x2)]).err();
    assert!(
        matches!(
            &err,
            Some(GraphError::CannotRepoint {
                node: 1,
                kind: "memset",
                ..
            })
        ),
        "the memset over x and w is refused, named: {err:?}"
    );
    assert_eq!(
        g.update_input_ptrs(&[whole(&x, &x2)]).err(),
        err,
        "by raw address: the same refusal"
    );
    g.replay(&stream)?;
    s.expect(&stream, &x, 7.0, "the refused update left the memset on x")?;
    s.expect(&stream, &w, 7.0, "and on w")?;
    s.expect(
        &stream,
        &x2,
        0.0,
        "x2 is not written: nothing was repointed",
    )
}

/// A harness over a fake driver with two devices.
fn two_device_harness() -> Harness {
    let fake = Arc::new(
        FakeDriver::builder()
            .devices(2)
            .completion(Completion::Manual)
            .build(),
    );
    register_fake_kernels(&fake);
    let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
    Harness::new(rt, Some(fake))
}

/// A graph of device 0 is not repointed at a buffer of device 1 (fake device: two devices).
#[test]
fn update_inputs_refuses_another_device() -> TestResult {
    let h = two_device_harness();
    let s = Setup::new(&h)?;
    let g = s.graph()?;
    let x = s.buffer(1.0)?;
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    s.add_one(capture.stream(), &x)?;
    capture.end()?;
    let elsewhere = DeviceBuffer::<f32>::filled(&h.rt, D1, N, 0.0)?;
    assert_eq!(
        g.update_inputs(&[(&x, &elsewhere)]),
        Err(GraphError::Stream(StreamError::DeviceMismatch {
            expected: D0,
            found: D1,
            what: "a new input"
        }))
    );
    Ok(())
}

/// A child graph (a graph launched inside a capture) is opaque to `update_inputs`, which
/// refuses rather than leave it reading the old buffer (fake device: the fake records a
/// launched graph as one node).
#[test]
fn update_inputs_refuses_an_opaque_node() -> TestResult {
    let h = ferrocuda_testkit::fake_harness();
    let s = Setup::new(&h)?;
    let (inner, outer) = (s.graph()?, s.graph()?);
    let x = s.buffer(1.0)?;
    let capture = inner.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    s.add_one(&stream, &x)?;
    capture.end()?;
    let capture = outer.capture(Some(&stream), None, CaptureMode::ThreadLocal)?;
    s.add_one(&stream, &x)?;
    inner.replay(&stream)?;
    capture.end()?;
    let x2 = s.buffer(0.0)?;
    s.h.rt.current_stream(D0)?.synchronize()?;
    assert!(
        matches!(
            outer.update_inputs(&[(&x, &x2)]),
            Err(GraphError::CannotRepoint {
                node: 1,
                kind: "child graph",
                ..
            })
        ),
        "a child graph may hold x: refused, named"
    );
    outer.replay(&stream)?;
    s.expect(&stream, &x, 3.0, "both kernels still add to x")
}

/// An update that fails half way changes nothing: when the driver fails the node sets in
/// the instance, or refuses them and then fails to set the captured graph's second node or
/// the whole update of the instance, the instance is put back and replays still use the old
/// buffer (fake device: the failures are injected).
#[test]
fn update_inputs_that_fails_midway_changes_nothing() -> TestResult {
    let h = ferrocuda_testkit::fake_harness();
    let fake = h.fake.clone().ok_or("the fake harness has a fake driver")?;
    let s = Setup::new(&h)?;
    let g = s.graph()?;
    let x = s.buffer(1.0)?;
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    x.fill(0.0)?;
    s.add_one(&stream, &x)?;
    capture.end()?;
    let x2 = s.buffer(5.0)?;
    s.h.rt.current_stream(D0)?.synchronize()?;
    let failures = [
        (None, Call::GraphExecSetNodes, 1),
        (Some(Call::GraphExecSetNodes), Call::GraphSetNode, 2),
        (Some(Call::GraphExecSetNodes), Call::GraphExecUpdate, 1),
    ];
    for (refused, call, nth) in failures {
        if let Some(refused) = refused {
            fake.fail_nth(refused, 1, DriverError::GRAPH_EXEC_UPDATE_FAILURE);
        }
        fake.fail_nth(call, nth, DriverError::INVALID_VALUE);
        assert_eq!(
            g.update_inputs(&[(&x, &x2)]),
            Err(GraphError::Driver(DriverError::INVALID_VALUE)),
            "{call:?} fails"
        );
        g.replay(&stream)?;
        s.expect(&stream, &x, 1.0, "the memset and the kernel still write x")?;
        s.expect(&stream, &x2, 5.0, "x2 is untouched")?;
    }
    assert_eq!(
        g.update_inputs(&[(&x, &x2)])?,
        InputUpdate::InPlace { pointers: 2 },
        "both nodes still held x"
    );
    g.replay(&stream)?;
    s.expect(&stream, &x2, 1.0, "now x2 is written")
}

/// `keep_instances(k)` for k of 1 to 3: a random walk over four (input, output) buffer
/// pairs, each step moving the graph to the pair it names. What each update reports follows
/// a model of the instances (the pair each holds, the launched one last): a pair an
/// instance holds is `Kept` (on the fake device, no driver call), a new pair is `Added`
/// while fewer than k instances exist, else the launched instance is updated `InPlace` (the
/// others keep their pairs). Every replay writes `2 x` of its pair. Lowering k to 1
/// destroys the others, and the next move updates in place.
pub(crate) fn kept_instances_serve_the_addresses_they_hold(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let calls = |c: Call| s.h.fake.as_ref().map_or(0, |f| f.calls(c));
    for keep in 1..=3usize {
        let g = s.graph()?;
        g.keep_instances(keep);
        let xs: Vec<DeviceBuffer<f32>> = (0..4)
            .map(|i| s.buffer(i as f32 + 1.0))
            .collect::<Result<_, _>>()?;
        let ys: Vec<DeviceBuffer<f32>> = (0..4).map(|_| s.buffer(0.0)).collect::<Result<_, _>>()?;
        let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
        let stream = capture.stream().clone();
        s.scale(&stream, &ys[0], &xs[0], 2.0)?;
        capture.end()?;
        // The pair each instance holds, the launched one last.
        let mut held = vec![0usize];
        let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ keep as u64;
        for step in 0..40 {
            rng = rng.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let (from, to) = (held[held.len() - 1], (rng >> 33) as usize % 4);
            if to == from {
                continue;
            }
            let expected = if let Some(i) = held.iter().position(|&p| p == to) {
                held.remove(i);
                InputUpdate::Kept { pointers: 2 }
            } else if held.len() < keep {
                InputUpdate::Added { pointers: 2 }
            } else {
                held.remove(0);
                InputUpdate::InPlace { pointers: 2 }
            };
            held.push(to);
            let driver = || {
                [
                    Call::GraphExecSetNodes,
                    Call::GraphExecUpdate,
                    Call::GraphSetNode,
                ]
                .map(calls)
            };
            let driver_before = driver();
            let pairs = [(&xs[from], &xs[to]), (&ys[from], &ys[to])];
            assert_eq!(
                g.update_inputs(&pairs)?,
                expected,
                "keep {keep}, step {step}"
            );
            if expected == (InputUpdate::Kept { pointers: 2 }) {
                assert_eq!(
                    driver(),
                    driver_before,
                    "a kept instance costs no driver call"
                );
            }
            ys[to].copy_from_host(&vec![0.0; N])?;
            s.h.rt.current_stream(D0)?.synchronize()?;
            g.replay(&stream)?;
            let value = 2.0 * (to as f32 + 1.0);
            s.expect(
                &stream,
                &ys[to],
                value,
                &format!("keep {keep}, step {step}"),
            )?;
        }
        let destroyed = calls(Call::GraphExecDestroy);
        g.keep_instances(1);
        if s.h.fake.is_some() {
            assert_eq!(
                calls(Call::GraphExecDestroy) - destroyed,
                held.len() as u64 - 1
            );
        }
        let (from, to) = (held[held.len() - 1], held[0]);
        if from != to {
            let pairs = [(&xs[from], &xs[to]), (&ys[from], &ys[to])];
            assert_eq!(
                g.update_inputs(&pairs)?,
                InputUpdate::InPlace { pointers: 2 }
            );
            g.replay(&stream)?;
            s.expect(
                &stream,
                &ys[to],
                2.0 * (to as f32 + 1.0),
                "after keep_instances(1)",
            )?;
        }
    }
    Ok(())
}

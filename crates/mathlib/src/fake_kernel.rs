//! The fake cuBLAS's GEMM as a kernel of the fake device: launched on the call's stream, it
//! runs in stream order, is recorded by a stream capture and runs again at each replay, as a
//! real cuBLAS kernel does. Its arithmetic is the host's, in f64 from the operands' values,
//! rounded once to C's type.
//!
//! Like cuBLAS with a workspace, it uses the workspace bound to the handle: each C is staged
//! there (its first bytes, up to the workspace's size) before it is written. Memory handed
//! to cuBLAS as a workspace is therefore written at every call, as on a GPU, and a test can
//! see a workspace that is still bound after its memory went to someone else.
use ferrocuda_driver::cublas::{DataType, GemmCall};
use ferrocuda_driver::{Driver, DriverError, FakeDriver, KernelContext};
use ferrocuda_types::{
    DeviceIndex, DevicePtr, FunctionHandle, KernelArg, LaunchConfig, StreamHandle,
};
use half::{bf16, f16};

/// The kernel's name, and the source the fake device loads it from.
const NAME: &str = "fake_cublas_gemm";
const SOURCE: &str = "extern \"C\" __global__ void fake_cublas_gemm(const void* call) {}";

/// At most this many bytes of a C are staged in the workspace.
const STAGED_BYTES: usize = 4096;

/// A [`GemmCall`] and the workspace, as the kernel's one by-value argument.
#[repr(C)]
#[derive(Copy, Clone, bytemuck::Pod, bytemuck::Zeroable)]
struct Args {
    /// Bit 0: A transposed; bit 1: B transposed.
    trans: u64,
    mnk: [u64; 3],
    abc: [u64; 3],
    lds: [u64; 3],
    /// A's and B's type, C's type ([`type_code`]).
    types: [u64; 2],
    alpha: f64,
    beta: f64,
    /// Batch count (1 for one GEMM) and strides in elements.
    count: u64,
    strides: [i64; 3],
    /// Address and bytes of the workspace (0 bytes: none).
    workspace: [u64; 2],
}

fn type_code(t: DataType) -> u64 {
    match t {
        DataType::F16 => 0,
        DataType::BF16 => 1,
        DataType::F32 => 2,
        DataType::F64 => 3,
    }
}

fn type_of(code: u64) -> Result<DataType, String> {
    Ok(match code {
        0 => DataType::F16,
        1 => DataType::BF16,
        2 => DataType::F32,
        3 => DataType::F64,
        _ => return Err(format!("unknown type code {code}")),
    })
}

/// Loads the kernel on `device` of `fake` (what a real cuBLAS handle's creation does for its
/// own kernels), registering its host function unless a test registered one.
pub(crate) fn load(fake: &FakeDriver, device: DeviceIndex) -> Result<FunctionHandle, DriverError> {
    fake.provide_kernel(NAME, run);
    let image = fake
        .compile_source(device, SOURCE, "fake_cublas")
        .map_err(|_| DriverError::INVALID_IMAGE)?;
    let module = fake.module_load(device, &image)?;
    fake.module_function(module, NAME)
}

/// Enqueues `call` on `stream`, staging through `workspace`.
pub(crate) fn launch(
    fake: &FakeDriver,
    function: FunctionHandle,
    stream: StreamHandle,
    call: &GemmCall,
    workspace: Option<(DevicePtr, u64)>,
) -> Result<(), DriverError> {
    let (count, strides) = call.batch.map_or((1, [0; 3]), |b| (b.count, b.strides));
    let (ws, ws_bytes) = workspace.unwrap_or((DevicePtr(0), 0));
    let args = Args {
        trans: u64::from(call.transa) | u64::from(call.transb) << 1,
        mnk: [call.m as u64, call.n as u64, call.k as u64],
        abc: [call.a.0, call.b.0, call.c.0],
        lds: call.lds.map(|l| l as u64),
        types: [type_code(call.ab_type), type_code(call.c_type)],
        alpha: call.alpha,
        beta: call.beta,
        count: count as u64,
        strides,
        workspace: [ws.0, ws_bytes],
    };
    let config = LaunchConfig::for_elements(call.m * call.n, 256);
    fake.launch(function, &config, &[KernelArg::value(&args)], stream)
}

/// The kernel's host function.
fn run(k: &mut KernelContext<'_>) -> Result<(), String> {
    let a: Args = k.arg(0)?;
    let [m, n, kk] = a.mnk.map(|v| v as usize);
    let [lda, ldb, ldc] = a.lds.map(|v| v as usize);
    let (ab_type, c_type) = (type_of(a.types[0])?, type_of(a.types[1])?);
    let (transa, transb) = (a.trans & 1 == 1, a.trans & 2 == 2);
    let (a_rows, a_cols) = if transa { (kk, m) } else { (m, kk) };
    let (b_rows, b_cols) = if transb { (n, kk) } else { (kk, n) };
    let at = |p: u64, i: u64, stride: i64, t: DataType| {
        DevicePtr(p.wrapping_add((i as i64 * stride) as u64 * size_of(t) as u64))
    };
    for i in 0..a.count {
        let a_ptr = at(a.abc[0], i, a.strides[0], ab_type);
        let b_ptr = at(a.abc[1], i, a.strides[1], ab_type);
        let c_ptr = at(a.abc[2], i, a.strides[2], c_type);
        let am = read_matrix(k, ab_type, a_ptr, lda, a_rows, a_cols)?;
        let bm = read_matrix(k, ab_type, b_ptr, ldb, b_rows, b_cols)?;
        let mut c = read_matrix(k, c_type, c_ptr, ldc, m, n)?;
        let a_at = |r: usize, col: usize| {
            if transa {
                am[r * lda + col]
            } else {
                am[col * lda + r]
            }
        };
        let b_at = |r: usize, col: usize| {
            if transb {
                bm[r * ldb + col]
            } else {
                bm[col * ldb + r]
            }
        };
        for col in 0..n {
            for r in 0..m {
                let dot: f64 = (0..kk).map(|x| a_at(r, x) * b_at(x, col)).sum();
                let old = if a.beta == 0.0 { 0.0 } else { c[col * ldc + r] };
                c[col * ldc + r] = a.alpha * dot + a.beta * old;
            }
        }
        if c.is_empty() {
            continue;
        }
        let bytes = write_elems(c_type, &c);
        let staged = bytes.len().min(STAGED_BYTES).min(a.workspace[1] as usize);
        if staged > 0 {
            k.write(DevicePtr(a.workspace[0]), &bytes[..staged])?;
        }
        k.write(c_ptr, &bytes)?;
    }
    Ok(())
}

/// Reads the column-major matrix at `ptr` (leading dimension `ld`, `cols` columns of
/// `rows` used rows).
fn read_matrix(
    k: &KernelContext<'_>,
    t: DataType,
    ptr: DevicePtr,
    ld: usize,
    rows: usize,
    cols: usize,
) -> Result<Vec<f64>, String> {
    if cols == 0 {
        return Ok(Vec::new());
    }
    let bytes = k.read::<u8>(ptr, (ld * (cols - 1) + rows) * size_of(t))?;
    Ok(read_elems(t, &bytes))
}

/// Elements of `t`, read from and written to bytes.
fn read_elems(t: DataType, bytes: &[u8]) -> Vec<f64> {
    match t {
        DataType::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        DataType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        DataType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect(),
        DataType::F64 => bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
            .collect(),
    }
}

fn write_elems(t: DataType, values: &[f64]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| match t {
            DataType::F16 => f16::from_f64(v).to_le_bytes().to_vec(),
            DataType::BF16 => bf16::from_f64(v).to_le_bytes().to_vec(),
            DataType::F32 => (v as f32).to_le_bytes().to_vec(),
            DataType::F64 => v.to_le_bytes().to_vec(),
        })
        .collect()
}

fn size_of(t: DataType) -> usize {
    match t {
        DataType::F16 | DataType::BF16 => 2,
        DataType::F32 => 4,
        DataType::F64 => 8,
    }
}

//! Driver errors: a CUDA result code with its name from a static table.
use std::fmt;

/// A failed driver call: CUDA's result code and its name.
///
/// Formatting reads a static table and never calls the driver, so an error can be printed
/// after the driver is gone or was never loaded. Codes below zero are ferrocuda's own
/// (no CUDA code exists for them).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct DriverError {
    /// CUDA's `CUresult` value (or a negative ferrocuda code).
    pub code: i32,
    /// The code's name, e.g. `"CUDA_ERROR_OUT_OF_MEMORY"`.
    pub name: &'static str,
}

/// Every `CUresult` of CUDA 13.0 with its name.
static TABLE: &[(i32, &str)] = &[
    (-6, "FERROCUDA_ADDRESS_PLAN_CONFLICT"),
    (-5, "FERROCUDA_ADDRESS_PLAN_EXHAUSTED"),
    (-4, "FERROCUDA_BAD_FORK"),
    (-3, "FERROCUDA_NVRTC_LIBRARY_NOT_FOUND"),
    (-2, "FERROCUDA_KERNEL_NOT_REGISTERED"),
    (-1, "FERROCUDA_DRIVER_LIBRARY_NOT_FOUND"),
    (0, "CUDA_SUCCESS"),
    (1, "CUDA_ERROR_INVALID_VALUE"),
    (2, "CUDA_ERROR_OUT_OF_MEMORY"),
    (3, "CUDA_ERROR_NOT_INITIALIZED"),
    (4, "CUDA_ERROR_DEINITIALIZED"),
    (5, "CUDA_ERROR_PROFILER_DISABLED"),
    (6, "CUDA_ERROR_PROFILER_NOT_INITIALIZED"),
    (7, "CUDA_ERROR_PROFILER_ALREADY_STARTED"),
    (8, "CUDA_ERROR_PROFILER_ALREADY_STOPPED"),
    (34, "CUDA_ERROR_STUB_LIBRARY"),
    (36, "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER"),
    (46, "CUDA_ERROR_DEVICE_UNAVAILABLE"),
    (47, "CUDA_ERROR_MULTICAST_RESOURCE_FULL"),
    (100, "CUDA_ERROR_NO_DEVICE"),
    (101, "CUDA_ERROR_INVALID_DEVICE"),
    (102, "CUDA_ERROR_DEVICE_NOT_LICENSED"),
    (200, "CUDA_ERROR_INVALID_IMAGE"),
    (201, "CUDA_ERROR_INVALID_CONTEXT"),
    (202, "CUDA_ERROR_CONTEXT_ALREADY_CURRENT"),
    (205, "CUDA_ERROR_MAP_FAILED"),
    (206, "CUDA_ERROR_UNMAP_FAILED"),
    (207, "CUDA_ERROR_ARRAY_IS_MAPPED"),
    (208, "CUDA_ERROR_ALREADY_MAPPED"),
    (209, "CUDA_ERROR_NO_BINARY_FOR_GPU"),
    (210, "CUDA_ERROR_ALREADY_ACQUIRED"),
    (211, "CUDA_ERROR_NOT_MAPPED"),
    (212, "CUDA_ERROR_NOT_MAPPED_AS_ARRAY"),
    (213, "CUDA_ERROR_NOT_MAPPED_AS_POINTER"),
    (214, "CUDA_ERROR_ECC_UNCORRECTABLE"),
    (215, "CUDA_ERROR_UNSUPPORTED_LIMIT"),
    (216, "CUDA_ERROR_CONTEXT_ALREADY_IN_USE"),
    (217, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"),
    (218, "CUDA_ERROR_INVALID_PTX"),
    (219, "CUDA_ERROR_INVALID_GRAPHICS_CONTEXT"),
    (220, "CUDA_ERROR_NVLINK_UNCORRECTABLE"),
    (221, "CUDA_ERROR_JIT_COMPILER_NOT_FOUND"),
    (222, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"),
    (223, "CUDA_ERROR_JIT_COMPILATION_DISABLED"),
    (224, "CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY"),
    (225, "CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC"),
    (226, "CUDA_ERROR_CONTAINED"),
    (227, "CUDA_ERROR_INSUFFICIENT_LOADER_VERSION"),
    (300, "CUDA_ERROR_INVALID_SOURCE"),
    (301, "CUDA_ERROR_FILE_NOT_FOUND"),
    (302, "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND"),
    (303, "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED"),
    (304, "CUDA_ERROR_OPERATING_SYSTEM"),
    (400, "CUDA_ERROR_INVALID_HANDLE"),
    (401, "CUDA_ERROR_ILLEGAL_STATE"),
    (402, "CUDA_ERROR_LOSSY_QUERY"),
    (500, "CUDA_ERROR_NOT_FOUND"),
    (600, "CUDA_ERROR_NOT_READY"),
    (700, "CUDA_ERROR_ILLEGAL_ADDRESS"),
    (701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"),
    (702, "CUDA_ERROR_LAUNCH_TIMEOUT"),
    (703, "CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING"),
    (704, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED"),
    (705, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED"),
    (708, "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE"),
    (709, "CUDA_ERROR_CONTEXT_IS_DESTROYED"),
    (710, "CUDA_ERROR_ASSERT"),
    (711, "CUDA_ERROR_TOO_MANY_PEERS"),
    (712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"),
    (713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"),
    (714, "CUDA_ERROR_HARDWARE_STACK_ERROR"),
    (715, "CUDA_ERROR_ILLEGAL_INSTRUCTION"),
    (716, "CUDA_ERROR_MISALIGNED_ADDRESS"),
    (717, "CUDA_ERROR_INVALID_ADDRESS_SPACE"),
    (718, "CUDA_ERROR_INVALID_PC"),
    (719, "CUDA_ERROR_LAUNCH_FAILED"),
    (720, "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE"),
    (721, "CUDA_ERROR_TENSOR_MEMORY_LEAK"),
    (800, "CUDA_ERROR_NOT_PERMITTED"),
    (801, "CUDA_ERROR_NOT_SUPPORTED"),
    (802, "CUDA_ERROR_SYSTEM_NOT_READY"),
    (803, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"),
    (804, "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE"),
    (805, "CUDA_ERROR_MPS_CONNECTION_FAILED"),
    (806, "CUDA_ERROR_MPS_RPC_FAILURE"),
    (807, "CUDA_ERROR_MPS_SERVER_NOT_READY"),
    (808, "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED"),
    (809, "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED"),
    (810, "CUDA_ERROR_MPS_CLIENT_TERMINATED"),
    (811, "CUDA_ERROR_CDP_NOT_SUPPORTED"),
    (812, "CUDA_ERROR_CDP_VERSION_MISMATCH"),
    (900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"),
    (901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"),
    (902, "CUDA_ERROR_STREAM_CAPTURE_MERGE"),
    (903, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED"),
    (904, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED"),
    (905, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION"),
    (906, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"),
    (907, "CUDA_ERROR_CAPTURED_EVENT"),
    (908, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD"),
    (909, "CUDA_ERROR_TIMEOUT"),
    (910, "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE"),
    (911, "CUDA_ERROR_EXTERNAL_DEVICE"),
    (912, "CUDA_ERROR_INVALID_CLUSTER_SIZE"),
    (913, "CUDA_ERROR_FUNCTION_NOT_LOADED"),
    (914, "CUDA_ERROR_INVALID_RESOURCE_TYPE"),
    (915, "CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION"),
    (916, "CUDA_ERROR_KEY_ROTATION"),
    (917, "CUDA_ERROR_STREAM_DETACHED"),
    (918, "CUDA_ERROR_GRAPH_RECAPTURE_FAILURE"),
    (919, "CUDA_ERROR_FABRIC_NOT_READY"),
    (999, "CUDA_ERROR_UNKNOWN"),
];

impl DriverError {
    /// The error for a raw code; unknown codes are named `"CUDA_ERROR_UNRECOGNIZED"`.
    pub fn from_code(code: i32) -> DriverError {
        let name = TABLE
            .iter()
            .find(|(c, _)| *c == code)
            .map_or("CUDA_ERROR_UNRECOGNIZED", |(_, n)| n);
        DriverError { code, name }
    }

    /// libcuda could not be loaded: there is no NVIDIA driver on this machine.
    pub const LIBRARY_NOT_FOUND: DriverError = DriverError {
        code: -1,
        name: "FERROCUDA_DRIVER_LIBRARY_NOT_FOUND",
    };
    /// The fake device has no host function registered under a kernel's name.
    pub const KERNEL_NOT_REGISTERED: DriverError = DriverError {
        code: -2,
        name: "FERROCUDA_KERNEL_NOT_REGISTERED",
    };
    /// libnvrtc could not be loaded, so CUDA source cannot be compiled.
    pub const NVRTC_NOT_FOUND: DriverError = DriverError {
        code: -3,
        name: "FERROCUDA_NVRTC_LIBRARY_NOT_FOUND",
    };
    /// A driver call in a child forked after CUDA was initialised in its parent (see
    /// [`fork`](crate::fork)). It displays as PyTorch's message for this case.
    pub const BAD_FORK: DriverError = DriverError {
        code: -4,
        name: "FERROCUDA_BAD_FORK",
    };
    /// A fake device in address mode with a strict plan was asked for more `malloc`s than
    /// the plan has addresses.
    pub const ADDRESS_PLAN_EXHAUSTED: DriverError = DriverError {
        code: -5,
        name: "FERROCUDA_ADDRESS_PLAN_EXHAUSTED",
    };
    /// A fake device in address mode with a strict plan: the next planned address would
    /// overlap memory still allocated (the program diverged from the recording).
    pub const ADDRESS_PLAN_CONFLICT: DriverError = DriverError {
        code: -6,
        name: "FERROCUDA_ADDRESS_PLAN_CONFLICT",
    };
    /// `CUDA_ERROR_INVALID_VALUE` (1).
    pub const INVALID_VALUE: DriverError = DriverError {
        code: 1,
        name: "CUDA_ERROR_INVALID_VALUE",
    };
    /// `CUDA_ERROR_OUT_OF_MEMORY` (2).
    pub const OUT_OF_MEMORY: DriverError = DriverError {
        code: 2,
        name: "CUDA_ERROR_OUT_OF_MEMORY",
    };
    /// `CUDA_ERROR_NOT_INITIALIZED` (3).
    pub const NOT_INITIALIZED: DriverError = DriverError {
        code: 3,
        name: "CUDA_ERROR_NOT_INITIALIZED",
    };
    /// `CUDA_ERROR_DEINITIALIZED` (4).
    pub const DEINITIALIZED: DriverError = DriverError {
        code: 4,
        name: "CUDA_ERROR_DEINITIALIZED",
    };
    /// `CUDA_ERROR_PROFILER_DISABLED` (5).
    pub const PROFILER_DISABLED: DriverError = DriverError {
        code: 5,
        name: "CUDA_ERROR_PROFILER_DISABLED",
    };
    /// `CUDA_ERROR_PROFILER_NOT_INITIALIZED` (6).
    pub const PROFILER_NOT_INITIALIZED: DriverError = DriverError {
        code: 6,
        name: "CUDA_ERROR_PROFILER_NOT_INITIALIZED",
    };
    /// `CUDA_ERROR_PROFILER_ALREADY_STARTED` (7).
    pub const PROFILER_ALREADY_STARTED: DriverError = DriverError {
        code: 7,
        name: "CUDA_ERROR_PROFILER_ALREADY_STARTED",
    };
    /// `CUDA_ERROR_PROFILER_ALREADY_STOPPED` (8).
    pub const PROFILER_ALREADY_STOPPED: DriverError = DriverError {
        code: 8,
        name: "CUDA_ERROR_PROFILER_ALREADY_STOPPED",
    };
    /// `CUDA_ERROR_STUB_LIBRARY` (34).
    pub const STUB_LIBRARY: DriverError = DriverError {
        code: 34,
        name: "CUDA_ERROR_STUB_LIBRARY",
    };
    /// `CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER` (36).
    pub const CALL_REQUIRES_NEWER_DRIVER: DriverError = DriverError {
        code: 36,
        name: "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER",
    };
    /// `CUDA_ERROR_DEVICE_UNAVAILABLE` (46).
    pub const DEVICE_UNAVAILABLE: DriverError = DriverError {
        code: 46,
        name: "CUDA_ERROR_DEVICE_UNAVAILABLE",
    };
    /// `CUDA_ERROR_MULTICAST_RESOURCE_FULL` (47).
    pub const MULTICAST_RESOURCE_FULL: DriverError = DriverError {
        code: 47,
        name: "CUDA_ERROR_MULTICAST_RESOURCE_FULL",
    };
    /// `CUDA_ERROR_NO_DEVICE` (100).
    pub const NO_DEVICE: DriverError = DriverError {
        code: 100,
        name: "CUDA_ERROR_NO_DEVICE",
    };
    /// `CUDA_ERROR_INVALID_DEVICE` (101).
    pub const INVALID_DEVICE: DriverError = DriverError {
        code: 101,
        name: "CUDA_ERROR_INVALID_DEVICE",
    };
    /// `CUDA_ERROR_DEVICE_NOT_LICENSED` (102).
    pub const DEVICE_NOT_LICENSED: DriverError = DriverError {
        code: 102,
        name: "CUDA_ERROR_DEVICE_NOT_LICENSED",
    };
    /// `CUDA_ERROR_INVALID_IMAGE` (200).
    pub const INVALID_IMAGE: DriverError = DriverError {
        code: 200,
        name: "CUDA_ERROR_INVALID_IMAGE",
    };
    /// `CUDA_ERROR_INVALID_CONTEXT` (201).
    pub const INVALID_CONTEXT: DriverError = DriverError {
        code: 201,
        name: "CUDA_ERROR_INVALID_CONTEXT",
    };
    /// `CUDA_ERROR_CONTEXT_ALREADY_CURRENT` (202).
    pub const CONTEXT_ALREADY_CURRENT: DriverError = DriverError {
        code: 202,
        name: "CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
    };
    /// `CUDA_ERROR_MAP_FAILED` (205).
    pub const MAP_FAILED: DriverError = DriverError {
        code: 205,
        name: "CUDA_ERROR_MAP_FAILED",
    };
    /// `CUDA_ERROR_UNMAP_FAILED` (206).
    pub const UNMAP_FAILED: DriverError = DriverError {
        code: 206,
        name: "CUDA_ERROR_UNMAP_FAILED",
    };
    /// `CUDA_ERROR_ARRAY_IS_MAPPED` (207).
    pub const ARRAY_IS_MAPPED: DriverError = DriverError {
        code: 207,
        name: "CUDA_ERROR_ARRAY_IS_MAPPED",
    };
    /// `CUDA_ERROR_ALREADY_MAPPED` (208).
    pub const ALREADY_MAPPED: DriverError = DriverError {
        code: 208,
        name: "CUDA_ERROR_ALREADY_MAPPED",
    };
    /// `CUDA_ERROR_NO_BINARY_FOR_GPU` (209).
    pub const NO_BINARY_FOR_GPU: DriverError = DriverError {
        code: 209,
        name: "CUDA_ERROR_NO_BINARY_FOR_GPU",
    };
    /// `CUDA_ERROR_ALREADY_ACQUIRED` (210).
    pub const ALREADY_ACQUIRED: DriverError = DriverError {
        code: 210,
        name: "CUDA_ERROR_ALREADY_ACQUIRED",
    };
    /// `CUDA_ERROR_NOT_MAPPED` (211).
    pub const NOT_MAPPED: DriverError = DriverError {
        code: 211,
        name: "CUDA_ERROR_NOT_MAPPED",
    };
    /// `CUDA_ERROR_NOT_MAPPED_AS_ARRAY` (212).
    pub const NOT_MAPPED_AS_ARRAY: DriverError = DriverError {
        code: 212,
        name: "CUDA_ERROR_NOT_MAPPED_AS_ARRAY",
    };
    /// `CUDA_ERROR_NOT_MAPPED_AS_POINTER` (213).
    pub const NOT_MAPPED_AS_POINTER: DriverError = DriverError {
        code: 213,
        name: "CUDA_ERROR_NOT_MAPPED_AS_POINTER",
    };
    /// `CUDA_ERROR_ECC_UNCORRECTABLE` (214).
    pub const ECC_UNCORRECTABLE: DriverError = DriverError {
        code: 214,
        name: "CUDA_ERROR_ECC_UNCORRECTABLE",
    };
    /// `CUDA_ERROR_UNSUPPORTED_LIMIT` (215).
    pub const UNSUPPORTED_LIMIT: DriverError = DriverError {
        code: 215,
        name: "CUDA_ERROR_UNSUPPORTED_LIMIT",
    };
    /// `CUDA_ERROR_CONTEXT_ALREADY_IN_USE` (216).
    pub const CONTEXT_ALREADY_IN_USE: DriverError = DriverError {
        code: 216,
        name: "CUDA_ERROR_CONTEXT_ALREADY_IN_USE",
    };
    /// `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED` (217).
    pub const PEER_ACCESS_UNSUPPORTED: DriverError = DriverError {
        code: 217,
        name: "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
    };
    /// `CUDA_ERROR_INVALID_PTX` (218).
    pub const INVALID_PTX: DriverError = DriverError {
        code: 218,
        name: "CUDA_ERROR_INVALID_PTX",
    };
    /// `CUDA_ERROR_INVALID_GRAPHICS_CONTEXT` (219).
    pub const INVALID_GRAPHICS_CONTEXT: DriverError = DriverError {
        code: 219,
        name: "CUDA_ERROR_INVALID_GRAPHICS_CONTEXT",
    };
    /// `CUDA_ERROR_NVLINK_UNCORRECTABLE` (220).
    pub const NVLINK_UNCORRECTABLE: DriverError = DriverError {
        code: 220,
        name: "CUDA_ERROR_NVLINK_UNCORRECTABLE",
    };
    /// `CUDA_ERROR_JIT_COMPILER_NOT_FOUND` (221).
    pub const JIT_COMPILER_NOT_FOUND: DriverError = DriverError {
        code: 221,
        name: "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
    };
    /// `CUDA_ERROR_UNSUPPORTED_PTX_VERSION` (222).
    pub const UNSUPPORTED_PTX_VERSION: DriverError = DriverError {
        code: 222,
        name: "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
    };
    /// `CUDA_ERROR_JIT_COMPILATION_DISABLED` (223).
    pub const JIT_COMPILATION_DISABLED: DriverError = DriverError {
        code: 223,
        name: "CUDA_ERROR_JIT_COMPILATION_DISABLED",
    };
    /// `CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY` (224).
    pub const UNSUPPORTED_EXEC_AFFINITY: DriverError = DriverError {
        code: 224,
        name: "CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY",
    };
    /// `CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC` (225).
    pub const UNSUPPORTED_DEVSIDE_SYNC: DriverError = DriverError {
        code: 225,
        name: "CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC",
    };
    /// `CUDA_ERROR_CONTAINED` (226).
    pub const CONTAINED: DriverError = DriverError {
        code: 226,
        name: "CUDA_ERROR_CONTAINED",
    };
    /// `CUDA_ERROR_INSUFFICIENT_LOADER_VERSION` (227).
    pub const INSUFFICIENT_LOADER_VERSION: DriverError = DriverError {
        code: 227,
        name: "CUDA_ERROR_INSUFFICIENT_LOADER_VERSION",
    };
    /// `CUDA_ERROR_INVALID_SOURCE` (300).
    pub const INVALID_SOURCE: DriverError = DriverError {
        code: 300,
        name: "CUDA_ERROR_INVALID_SOURCE",
    };
    /// `CUDA_ERROR_FILE_NOT_FOUND` (301).
    pub const FILE_NOT_FOUND: DriverError = DriverError {
        code: 301,
        name: "CUDA_ERROR_FILE_NOT_FOUND",
    };
    /// `CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND` (302).
    pub const SHARED_OBJECT_SYMBOL_NOT_FOUND: DriverError = DriverError {
        code: 302,
        name: "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND",
    };
    /// `CUDA_ERROR_SHARED_OBJECT_INIT_FAILED` (303).
    pub const SHARED_OBJECT_INIT_FAILED: DriverError = DriverError {
        code: 303,
        name: "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED",
    };
    /// `CUDA_ERROR_OPERATING_SYSTEM` (304).
    pub const OPERATING_SYSTEM: DriverError = DriverError {
        code: 304,
        name: "CUDA_ERROR_OPERATING_SYSTEM",
    };
    /// `CUDA_ERROR_INVALID_HANDLE` (400).
    pub const INVALID_HANDLE: DriverError = DriverError {
        code: 400,
        name: "CUDA_ERROR_INVALID_HANDLE",
    };
    /// `CUDA_ERROR_ILLEGAL_STATE` (401).
    pub const ILLEGAL_STATE: DriverError = DriverError {
        code: 401,
        name: "CUDA_ERROR_ILLEGAL_STATE",
    };
    /// `CUDA_ERROR_LOSSY_QUERY` (402).
    pub const LOSSY_QUERY: DriverError = DriverError {
        code: 402,
        name: "CUDA_ERROR_LOSSY_QUERY",
    };
    /// `CUDA_ERROR_NOT_FOUND` (500).
    pub const NOT_FOUND: DriverError = DriverError {
        code: 500,
        name: "CUDA_ERROR_NOT_FOUND",
    };
    /// `CUDA_ERROR_NOT_READY` (600).
    pub const NOT_READY: DriverError = DriverError {
        code: 600,
        name: "CUDA_ERROR_NOT_READY",
    };
    /// `CUDA_ERROR_ILLEGAL_ADDRESS` (700).
    pub const ILLEGAL_ADDRESS: DriverError = DriverError {
        code: 700,
        name: "CUDA_ERROR_ILLEGAL_ADDRESS",
    };
    /// `CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES` (701).
    pub const LAUNCH_OUT_OF_RESOURCES: DriverError = DriverError {
        code: 701,
        name: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
    };
    /// `CUDA_ERROR_LAUNCH_TIMEOUT` (702).
    pub const LAUNCH_TIMEOUT: DriverError = DriverError {
        code: 702,
        name: "CUDA_ERROR_LAUNCH_TIMEOUT",
    };
    /// `CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING` (703).
    pub const LAUNCH_INCOMPATIBLE_TEXTURING: DriverError = DriverError {
        code: 703,
        name: "CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING",
    };
    /// `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED` (704).
    pub const PEER_ACCESS_ALREADY_ENABLED: DriverError = DriverError {
        code: 704,
        name: "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
    };
    /// `CUDA_ERROR_PEER_ACCESS_NOT_ENABLED` (705).
    pub const PEER_ACCESS_NOT_ENABLED: DriverError = DriverError {
        code: 705,
        name: "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
    };
    /// `CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE` (708).
    pub const PRIMARY_CONTEXT_ACTIVE: DriverError = DriverError {
        code: 708,
        name: "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE",
    };
    /// `CUDA_ERROR_CONTEXT_IS_DESTROYED` (709).
    pub const CONTEXT_IS_DESTROYED: DriverError = DriverError {
        code: 709,
        name: "CUDA_ERROR_CONTEXT_IS_DESTROYED",
    };
    /// `CUDA_ERROR_ASSERT` (710).
    pub const ASSERT: DriverError = DriverError {
        code: 710,
        name: "CUDA_ERROR_ASSERT",
    };
    /// `CUDA_ERROR_TOO_MANY_PEERS` (711).
    pub const TOO_MANY_PEERS: DriverError = DriverError {
        code: 711,
        name: "CUDA_ERROR_TOO_MANY_PEERS",
    };
    /// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED` (712).
    pub const HOST_MEMORY_ALREADY_REGISTERED: DriverError = DriverError {
        code: 712,
        name: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
    };
    /// `CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED` (713).
    pub const HOST_MEMORY_NOT_REGISTERED: DriverError = DriverError {
        code: 713,
        name: "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
    };
    /// `CUDA_ERROR_HARDWARE_STACK_ERROR` (714).
    pub const HARDWARE_STACK_ERROR: DriverError = DriverError {
        code: 714,
        name: "CUDA_ERROR_HARDWARE_STACK_ERROR",
    };
    /// `CUDA_ERROR_ILLEGAL_INSTRUCTION` (715).
    pub const ILLEGAL_INSTRUCTION: DriverError = DriverError {
        code: 715,
        name: "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    };
    /// `CUDA_ERROR_MISALIGNED_ADDRESS` (716).
    pub const MISALIGNED_ADDRESS: DriverError = DriverError {
        code: 716,
        name: "CUDA_ERROR_MISALIGNED_ADDRESS",
    };
    /// `CUDA_ERROR_INVALID_ADDRESS_SPACE` (717).
    pub const INVALID_ADDRESS_SPACE: DriverError = DriverError {
        code: 717,
        name: "CUDA_ERROR_INVALID_ADDRESS_SPACE",
    };
    /// `CUDA_ERROR_INVALID_PC` (718).
    pub const INVALID_PC: DriverError = DriverError {
        code: 718,
        name: "CUDA_ERROR_INVALID_PC",
    };
    /// `CUDA_ERROR_LAUNCH_FAILED` (719).
    pub const LAUNCH_FAILED: DriverError = DriverError {
        code: 719,
        name: "CUDA_ERROR_LAUNCH_FAILED",
    };
    /// `CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE` (720).
    pub const COOPERATIVE_LAUNCH_TOO_LARGE: DriverError = DriverError {
        code: 720,
        name: "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
    };
    /// `CUDA_ERROR_TENSOR_MEMORY_LEAK` (721).
    pub const TENSOR_MEMORY_LEAK: DriverError = DriverError {
        code: 721,
        name: "CUDA_ERROR_TENSOR_MEMORY_LEAK",
    };
    /// `CUDA_ERROR_NOT_PERMITTED` (800).
    pub const NOT_PERMITTED: DriverError = DriverError {
        code: 800,
        name: "CUDA_ERROR_NOT_PERMITTED",
    };
    /// `CUDA_ERROR_NOT_SUPPORTED` (801).
    pub const NOT_SUPPORTED: DriverError = DriverError {
        code: 801,
        name: "CUDA_ERROR_NOT_SUPPORTED",
    };
    /// `CUDA_ERROR_SYSTEM_NOT_READY` (802).
    pub const SYSTEM_NOT_READY: DriverError = DriverError {
        code: 802,
        name: "CUDA_ERROR_SYSTEM_NOT_READY",
    };
    /// `CUDA_ERROR_SYSTEM_DRIVER_MISMATCH` (803).
    pub const SYSTEM_DRIVER_MISMATCH: DriverError = DriverError {
        code: 803,
        name: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
    };
    /// `CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE` (804).
    pub const COMPAT_NOT_SUPPORTED_ON_DEVICE: DriverError = DriverError {
        code: 804,
        name: "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
    };
    /// `CUDA_ERROR_MPS_CONNECTION_FAILED` (805).
    pub const MPS_CONNECTION_FAILED: DriverError = DriverError {
        code: 805,
        name: "CUDA_ERROR_MPS_CONNECTION_FAILED",
    };
    /// `CUDA_ERROR_MPS_RPC_FAILURE` (806).
    pub const MPS_RPC_FAILURE: DriverError = DriverError {
        code: 806,
        name: "CUDA_ERROR_MPS_RPC_FAILURE",
    };
    /// `CUDA_ERROR_MPS_SERVER_NOT_READY` (807).
    pub const MPS_SERVER_NOT_READY: DriverError = DriverError {
        code: 807,
        name: "CUDA_ERROR_MPS_SERVER_NOT_READY",
    };
    /// `CUDA_ERROR_MPS_MAX_CLIENTS_REACHED` (808).
    pub const MPS_MAX_CLIENTS_REACHED: DriverError = DriverError {
        code: 808,
        name: "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED",
    };
    /// `CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED` (809).
    pub const MPS_MAX_CONNECTIONS_REACHED: DriverError = DriverError {
        code: 809,
        name: "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED",
    };
    /// `CUDA_ERROR_MPS_CLIENT_TERMINATED` (810).
    pub const MPS_CLIENT_TERMINATED: DriverError = DriverError {
        code: 810,
        name: "CUDA_ERROR_MPS_CLIENT_TERMINATED",
    };
    /// `CUDA_ERROR_CDP_NOT_SUPPORTED` (811).
    pub const CDP_NOT_SUPPORTED: DriverError = DriverError {
        code: 811,
        name: "CUDA_ERROR_CDP_NOT_SUPPORTED",
    };
    /// `CUDA_ERROR_CDP_VERSION_MISMATCH` (812).
    pub const CDP_VERSION_MISMATCH: DriverError = DriverError {
        code: 812,
        name: "CUDA_ERROR_CDP_VERSION_MISMATCH",
    };
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` (900).
    pub const STREAM_CAPTURE_UNSUPPORTED: DriverError = DriverError {
        code: 900,
        name: "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
    };
    /// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` (901).
    pub const STREAM_CAPTURE_INVALIDATED: DriverError = DriverError {
        code: 901,
        name: "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
    };
    /// `CUDA_ERROR_STREAM_CAPTURE_MERGE` (902).
    pub const STREAM_CAPTURE_MERGE: DriverError = DriverError {
        code: 902,
        name: "CUDA_ERROR_STREAM_CAPTURE_MERGE",
    };
    /// `CUDA_ERROR_STREAM_CAPTURE_UNMATCHED` (903).
    pub const STREAM_CAPTURE_UNMATCHED: DriverError = DriverError {
        code: 903,
        name: "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
    };
    /// `CUDA_ERROR_STREAM_CAPTURE_UNJOINED` (904).
    pub const STREAM_CAPTURE_UNJOINED: DriverError = DriverError {
        code: 904,
        name: "CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
    };
    /// `CUDA_ERROR_STREAM_CAPTURE_ISOLATION` (905).
    pub const STREAM_CAPTURE_ISOLATION: DriverError = DriverError {
        code: 905,
        name: "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
    };
    /// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` (906).
    pub const STREAM_CAPTURE_IMPLICIT: DriverError = DriverError {
        code: 906,
        name: "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
    };
    /// `CUDA_ERROR_CAPTURED_EVENT` (907).
    pub const CAPTURED_EVENT: DriverError = DriverError {
        code: 907,
        name: "CUDA_ERROR_CAPTURED_EVENT",
    };
    /// `CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD` (908).
    pub const STREAM_CAPTURE_WRONG_THREAD: DriverError = DriverError {
        code: 908,
        name: "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
    };
    /// `CUDA_ERROR_TIMEOUT` (909).
    pub const TIMEOUT: DriverError = DriverError {
        code: 909,
        name: "CUDA_ERROR_TIMEOUT",
    };
    /// `CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE` (910).
    pub const GRAPH_EXEC_UPDATE_FAILURE: DriverError = DriverError {
        code: 910,
        name: "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE",
    };
    /// `CUDA_ERROR_EXTERNAL_DEVICE` (911).
    pub const EXTERNAL_DEVICE: DriverError = DriverError {
        code: 911,
        name: "CUDA_ERROR_EXTERNAL_DEVICE",
    };
    /// `CUDA_ERROR_INVALID_CLUSTER_SIZE` (912).
    pub const INVALID_CLUSTER_SIZE: DriverError = DriverError {
        code: 912,
        name: "CUDA_ERROR_INVALID_CLUSTER_SIZE",
    };
    /// `CUDA_ERROR_FUNCTION_NOT_LOADED` (913).
    pub const FUNCTION_NOT_LOADED: DriverError = DriverError {
        code: 913,
        name: "CUDA_ERROR_FUNCTION_NOT_LOADED",
    };
    /// `CUDA_ERROR_INVALID_RESOURCE_TYPE` (914).
    pub const INVALID_RESOURCE_TYPE: DriverError = DriverError {
        code: 914,
        name: "CUDA_ERROR_INVALID_RESOURCE_TYPE",
    };
    /// `CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION` (915).
    pub const INVALID_RESOURCE_CONFIGURATION: DriverError = DriverError {
        code: 915,
        name: "CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION",
    };
    /// `CUDA_ERROR_KEY_ROTATION` (916).
    pub const KEY_ROTATION: DriverError = DriverError {
        code: 916,
        name: "CUDA_ERROR_KEY_ROTATION",
    };
    /// `CUDA_ERROR_STREAM_DETACHED` (917).
    pub const STREAM_DETACHED: DriverError = DriverError {
        code: 917,
        name: "CUDA_ERROR_STREAM_DETACHED",
    };
    /// `CUDA_ERROR_GRAPH_RECAPTURE_FAILURE` (918).
    pub const GRAPH_RECAPTURE_FAILURE: DriverError = DriverError {
        code: 918,
        name: "CUDA_ERROR_GRAPH_RECAPTURE_FAILURE",
    };
    /// `CUDA_ERROR_FABRIC_NOT_READY` (919).
    pub const FABRIC_NOT_READY: DriverError = DriverError {
        code: 919,
        name: "CUDA_ERROR_FABRIC_NOT_READY",
    };
    /// `CUDA_ERROR_UNKNOWN` (999).
    pub const UNKNOWN: DriverError = DriverError {
        code: 999,
        name: "CUDA_ERROR_UNKNOWN",
    };

    /// Whether this is an out-of-memory error.
    pub fn is_out_of_memory(&self) -> bool {
        self.code == Self::OUT_OF_MEMORY.code
    }
}

/// PyTorch's message for a CUDA call in a bad fork (`torch.cuda._lazy_init`).
const BAD_FORK_MESSAGE: &str = "Cannot re-initialize CUDA in forked subprocess. To use CUDA with \
                                multiprocessing, you must use the 'spawn' start method";

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if *self == Self::BAD_FORK {
            return f.write_str(BAD_FORK_MESSAGE);
        }
        write!(f, "{} ({})", self.name, self.code)
    }
}

impl std::error::Error for DriverError {}

/// Compiling CUDA source failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CompileError {
    /// The compiler rejected the source; `log` is its message.
    #[error("kernel compilation failed:\n{log}")]
    Rejected {
        /// The compiler's log.
        log: String,
    },
    /// The driver or compiler library failed.
    #[error(transparent)]
    Driver(#[from] DriverError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_from_the_table() {
        assert_eq!(DriverError::from_code(2), DriverError::OUT_OF_MEMORY);
        assert_eq!(
            DriverError::from_code(904).to_string(),
            "CUDA_ERROR_STREAM_CAPTURE_UNJOINED (904)"
        );
        assert_eq!(
            DriverError::from_code(12345).name,
            "CUDA_ERROR_UNRECOGNIZED"
        );
        assert!(
            TABLE.windows(2).all(|w| w[0].0 < w[1].0),
            "table sorted and unique"
        );
    }

    #[test]
    fn a_bad_fork_reads_as_pytorch_says_it() {
        assert_eq!(DriverError::from_code(-4), DriverError::BAD_FORK);
        assert_eq!(
            DriverError::BAD_FORK.to_string(),
            "Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, \
             you must use the 'spawn' start method"
        );
    }
}

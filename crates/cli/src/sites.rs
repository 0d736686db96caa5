//! Allocation sites: which line of the user's program a recorded stack points at, so the
//! reports can answer "what holds my memory" by code location.
//!
//! PyTorch records a stack per block (innermost frame first): its own C++ frames
//! (the unwinder, the allocator, the dispatcher), then Python's. Frames PyTorch's viewer
//! hides are hidden here too (`torch/cuda/_memory_viz.py`, `_frame_filter`). A block's site is
//! its innermost Python frame outside installed packages and the standard library (the
//! user's line), else its innermost Python frame, else its innermost C++ frame outside PyTorch's core (`c10::`, `at::`, the
//! allocator). A block without a stack of its own (history recorded without context for
//! blocks) takes the stack of the last `alloc` event at its address.
use crate::recording::{Frame, Recording, StackId, TraceAction};
use rustc_hash::FxHashMap;

/// Functions `_frame_filter` omits.
const OMIT_FUNCTIONS: [&str; 8] = [
    "unwind::unwind",
    "CapturedTraceback::gather",
    "gather_with_cpp",
    "_start",
    "__libc_start_main",
    "PyEval_",
    "PyObject_",
    "PyFunction_",
];

/// File names `_frame_filter` omits.
const OMIT_FILENAMES: [&str; 10] = [
    "core/boxing",
    "/Register",
    "/Redispatch",
    "pythonrun.c",
    "Modules/main.c",
    "Objects/call.c",
    "Objects/methodobject.c",
    "pycore_ceval.h",
    "ceval.c",
    "cpython/abstract.h",
];

/// Where installed Python code lives (PyTorch's own files among it): a frame elsewhere is
/// the user's.
const LIBRARY_PATHS: [&str; 4] = [
    "/site-packages/",
    "/dist-packages/",
    "/lib/python3",
    "<frozen ",
];

/// Longest text of one frame in a report (a recording may hold megabyte-long names).
const MAX_FRAME_TEXT: usize = 200;

/// Most frames of one stack shown on hover.
const MAX_FRAMES_SHOWN: usize = 40;

/// A C++ function's name without its argument list: cut at the first `(` outside template
/// brackets that does not open `(anonymous namespace)` (or `operator()`'s own parentheses).
fn without_arguments(name: &str) -> &str {
    let mut angle = 0usize;
    for (i, c) in name.char_indices() {
        match c {
            '<' => angle += 1,
            '>' => angle = angle.saturating_sub(1),
            '(' if angle == 0 => {
                let rest = &name[i..];
                if rest.starts_with("(anonymous namespace)") || name[..i].ends_with("operator") {
                    continue;
                }
                return &name[..i];
            }
            _ => {}
        }
    }
    name
}

/// Where blocks were allocated: a frame, and one stack that has it (for the hover text).
#[derive(Copy, Clone, Debug)]
pub struct Site {
    /// The frame, or none where nothing was recorded.
    pub frame: Option<Frame>,
    /// A stack with this site.
    pub example: StackId,
}

impl PartialEq for Site {
    fn eq(&self, other: &Site) -> bool {
        self.frame == other.frame
    }
}

/// The sites of a recording.
#[derive(Debug)]
pub struct Sites<'a> {
    recording: &'a Recording,
    last_alloc: FxHashMap<(u16, u64), StackId>,
}

fn shorten(text: &str) -> &str {
    match text.char_indices().nth(MAX_FRAME_TEXT) {
        Some((end, _)) => &text[..end],
        None => text,
    }
}

impl<'a> Sites<'a> {
    /// Indexes the stacks of `recording`'s `alloc` events by address.
    pub fn new(recording: &'a Recording) -> Sites<'a> {
        let mut last_alloc = FxHashMap::default();
        for (device, trace) in recording.traces.iter().enumerate() {
            let Ok(device) = u16::try_from(device) else {
                continue;
            };
            for e in trace {
                if e.action == TraceAction::Alloc && e.stack != StackId::NONE {
                    last_alloc.insert((device, e.addr), e.stack);
                }
            }
        }
        Sites {
            recording,
            last_alloc,
        }
    }

    /// A block's stack: its own, else the last `alloc` event's at its address.
    pub fn stack_of_block(&self, device: u16, address: u64, own: StackId) -> StackId {
        if own != StackId::NONE {
            return own;
        }
        self.last_alloc
            .get(&(device, address))
            .copied()
            .unwrap_or(StackId::NONE)
    }

    fn text(&self, frame: &Frame) -> (&str, &str) {
        let stacks = &self.recording.stacks;
        (stacks.text(frame.name), stacks.text(frame.filename))
    }

    fn shown(&self, frame: &Frame) -> bool {
        let (name, filename) = self.text(frame);
        !OMIT_FUNCTIONS.iter().any(|f| name.contains(f))
            && !OMIT_FILENAMES.iter().any(|f| filename.contains(f))
    }

    /// The site of a stack.
    pub fn site(&self, stack: StackId) -> Site {
        let frames: Vec<&Frame> = self
            .recording
            .stacks
            .frames(stack)
            .filter(|f| self.shown(f))
            .collect();
        let python = |f: &&&Frame| self.text(f).1.ends_with(".py");
        let user = |f: &&&Frame| {
            let file = self.text(f).1;
            python(f) && !LIBRARY_PATHS.iter().any(|lib| file.contains(lib))
        };
        // A C++-only stack (the autograd engine's thread): the autograd node that ran.
        let autograd_node = |f: &&&Frame| {
            let name = self.text(f).0;
            name.contains("Backward") && name.contains("::apply")
        };
        let outside_core = |f: &&&Frame| {
            let name = self.text(f).0;
            !name.is_empty()
                && ![
                    "c10::", "at::", "std::", "torch::", "pthread", "__clone", "??",
                ]
                .iter()
                .any(|core| name.starts_with(core))
        };
        let frame = frames
            .iter()
            .find(user)
            .or_else(|| frames.iter().find(python))
            .or_else(|| frames.iter().find(autograd_node))
            .or_else(|| frames.iter().find(outside_core))
            .or_else(|| frames.first())
            .map(|f| **f);
        Site {
            frame,
            example: stack,
        }
    }

    /// A site in one line: `file:line function`.
    pub fn describe(&self, site: Site) -> String {
        match site.frame {
            Some(f) => self.frame_line(&f),
            None => "(no stack recorded)".into(),
        }
    }

    fn frame_line(&self, f: &Frame) -> String {
        let (name, filename) = self.text(f);
        if filename.ends_with(".py") {
            return format!("{}:{} {}", shorten(filename), f.line, shorten(name));
        }
        // A C++ frame: the function without its argument list, which can run to kilobytes
        // of template parameters.
        let function = without_arguments(name);
        match (filename, f.line) {
            ("" | "??", _) => shorten(function).to_owned(),
            (file, 0) => format!("{} ({})", shorten(function), shorten(file)),
            (file, line) => format!("{} ({}:{line})", shorten(function), shorten(file)),
        }
    }

    /// A stack as lines, innermost first, with the frames PyTorch's viewer hides left out.
    pub fn stack_text(&self, stack: StackId) -> String {
        let lines: Vec<String> = self
            .recording
            .stacks
            .frames(stack)
            .filter(|f| self.shown(f))
            .take(MAX_FRAMES_SHOWN)
            .map(|f| self.frame_line(f))
            .collect();
        if lines.is_empty() {
            "no stack recorded".into()
        } else {
            lines.join("\n")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::without_arguments;

    #[test]
    fn cpp_names_lose_only_their_argument_lists() {
        for (name, shown) in [
            (
                "at::native::(anonymous namespace)::addmm_out_cuda_impl(at::Tensor&, at::Tensor const&)",
                "at::native::(anonymous namespace)::addmm_out_cuda_impl",
            ),
            (
                "c10::impl::wrap_kernel_functor_unboxed_<c10::CompileTimeFunctionPointer<at::Tensor (at::Tensor const&), &f>>::call(c10::OperatorKernel*)",
                "c10::impl::wrap_kernel_functor_unboxed_<c10::CompileTimeFunctionPointer<at::Tensor (at::Tensor const&), &f>>::call",
            ),
            (
                "torch::autograd::Node::operator()(std::vector<at::Tensor>&&)",
                "torch::autograd::Node::operator()",
            ),
            ("__clone", "__clone"),
        ] {
            assert_eq!(without_arguments(name), shown);
        }
    }
}

//! `ferrocuda`: replay PyTorch allocation traces through ferrocuda's allocator.
//!
//! Every failure ends the command with one line on stderr (`ferrocuda: ...`) and exit code
//! 1; a reader that closes the pipe early ends it quietly with exit code 0.
#![forbid(unsafe_code)]

use clap::{Parser, Subcommand, ValueEnum};
use ferrocuda_cli::graph_plan;
use ferrocuda_cli::input::Limits;
use ferrocuda_cli::options::{AddressChoice, choose_device, parse_max_bytes, resolve_confs};
use ferrocuda_cli::pytorch;
use ferrocuda_cli::recording::Recording;
use ferrocuda_cli::replay::{Device, Figures};
use ferrocuda_cli::report::{plot_html, summary};
use ferrocuda_cli::trace::{events, read_recording_within, segment_addresses};
use ferrocuda_types::format_size;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "ferrocuda",
    version,
    about = "ferrocuda tools: replay, summarise and plot PyTorch memory snapshots, and plan CUDA graphs' memory"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// The most pickle bytes a snapshot may decompress to (`512M`, `4G`; 1M to 1T; default
    /// 1G); half of it bounds the bytes of its distinct strings, and a sixteenth of it the
    /// number of values it holds. Raise it for a recording of more than about 15 million
    /// events.
    #[arg(long = "max-bytes", global = true, value_name = "SIZE")]
    max_bytes: Option<String>,
}

#[derive(Subcommand)]
enum Command {
    /// Replays a PyTorch memory snapshot's device traces through ferrocuda's allocator on the
    /// fake device (or the GPU with --device cuda), once per --conf, and prints the figures
    /// side by side, with the allocator's time per alloc or free event (each device of the
    /// trace separately, on a fake device of its own or on cuda:0 in turn).
    Replay {
        /// A snapshot from torch.cuda.memory._snapshot() (pickle, optionally .xz or .gz).
        trace: PathBuf,
        /// An allocator configuration (PYTORCH_CUDA_ALLOC_CONF grammar; `default` or "" for
        /// the defaults); repeat for columns. Without it: FERROCUDA_ALLOC_CONF, else
        /// PYTORCH_CUDA_ALLOC_CONF, else PYTORCH_ALLOC_CONF, else the defaults.
        #[arg(long = "conf")]
        confs: Vec<String>,
        /// Where to replay: `fake`, the fake device in host memory, or `cuda`, the real
        /// driver's device 0 (a GPU is needed).
        #[arg(long, value_enum, default_value_t = DeviceArg::Fake)]
        device: DeviceArg,
        /// Memory of each fake device: GiB (`80`) or with a unit (`80G`, `512M`, `1T`);
        /// 2M to 4T. Default 80. Fake device only.
        #[arg(long)]
        capacity: Option<String>,
        /// PyTorch's figures to show beside ours (rows of model, conf and figures, as in
        /// tests/data/pytorch-figures.json). Default: the recording's own memory_stats,
        /// else a pytorch-figures.json beside the trace.
        #[arg(long = "pytorch-figures")]
        pytorch_figures: Option<PathBuf>,
        /// Print a JSON array instead of a table.
        #[arg(long)]
        json: bool,
        /// Where the fake device puts segments: `fresh` increasing addresses (the default),
        /// or the `recorded` ones (the trace's segment_alloc events, in order, per device),
        /// so best-fit ties between segments break as they did in the recording. Fake device
        /// only.
        #[arg(long, value_enum)]
        addresses: Option<Addresses>,
        /// Place the fake device's segments where a replay of the same trace placed its
        /// own: FILE is that replay's --json output (typically with --device cuda, whose
        /// rows carry the driver's segment addresses), read per device and configuration,
        /// so that best-fit ties break as they did on the GPU. Fake device only.
        #[arg(
            long = "addresses-from",
            value_name = "FILE",
            conflicts_with = "addresses"
        )]
        addresses_from: Option<PathBuf>,
        /// Let the fake device run queued work (the allocator's events) only at every Nth
        /// trace step, as a GPU the host runs ahead of, instead of at once: what page
        /// reclaim (`expandable_segments_reclaim`) saves depends on how far the device
        /// lags. Fake device only.
        #[arg(long = "catch-up-every", value_name = "N")]
        catch_up_every: Option<u64>,
    },
    /// Prints PyTorch's memory_summary table for a snapshot (current state from its
    /// segments, peaks of requested and reserved bytes from its history), then what holds
    /// the memory: the largest live blocks and the allocation sites by live bytes, from the
    /// recorded stacks, and the private pools (CUDA graph captures, MemPools).
    Summary {
        /// A snapshot (pickle, optionally .xz or .gz).
        snapshot: PathBuf,
    },
    /// Prints the bytes a CUDA graph capture's private pool will reserve, before capturing:
    /// each snapshot is one capture's warm-up (recorded with
    /// torch.cuda.memory._record_memory_history(enabled="all") switched on just before it),
    /// several are captures sharing one pool, in capture order. The warm-up's requests go
    /// through the allocator's rules on a fake device, once per --conf.
    Plan {
        /// Snapshots of the warm-ups (pickle, optionally .xz or .gz), in capture order.
        #[arg(required = true)]
        warmups: Vec<PathBuf>,
        /// The allocator configuration the program captures under (as for replay).
        #[arg(long = "conf")]
        confs: Vec<String>,
        /// The blocks a capture leaves allocated (its outputs) are freed before the next
        /// capture (vLLM keeps only weak references to them); by default they stay.
        #[arg(long = "free-outputs")]
        free_outputs: bool,
        /// Print a JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Writes a self-contained HTML page with the memory timeline, the largest live blocks
    /// (their stacks on hover) and the allocation sites by live bytes.
    Plot {
        /// A snapshot (pickle, optionally .xz or .gz).
        snapshot: PathBuf,
        /// The page to write.
        #[arg(short = 'o', long = "output")]
        output: PathBuf,
    },
}

/// `replay --device`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum DeviceArg {
    /// The fake device in host memory.
    Fake,
    /// The real CUDA driver's device 0.
    Cuda,
}

/// `replay --addresses`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum Addresses {
    /// Fresh, increasing addresses.
    Fresh,
    /// The trace's segment_alloc addresses, in order.
    Recorded,
}

/// How the command ended, other than by succeeding.
enum Failure {
    /// The reader of stdout went away: end quietly.
    BrokenPipe,
    /// Anything else: one line on stderr.
    Message(String),
}

impl<E: std::fmt::Display> From<E> for Failure {
    fn from(e: E) -> Failure {
        Failure::Message(e.to_string())
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // --help and --version print and succeed; an argument error is one line and exit
        // code 1, as every other failure.
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "ferrocuda: {}", one_line(&e));
            return ExitCode::FAILURE;
        }
    };
    match run(cli) {
        Ok(()) | Err(Failure::BrokenPipe) => ExitCode::SUCCESS,
        Err(Failure::Message(m)) => {
            // stderr may be unwritable too: nothing more to do then than the exit code.
            let _ = writeln!(std::io::stderr(), "ferrocuda: {}", m.replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}

/// Clap's message in one line: its first line (`error: ...`) without the prefix, the
/// indented lines under it (the arguments missing, the values possible), its tip, and where
/// to look for the usage.
fn one_line(e: &clap::Error) -> String {
    if e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
        return "a subcommand is needed: replay, summary, plan or plot (see ferrocuda --help)"
            .into();
    }
    let text = e.to_string();
    let mut lines = text.lines().skip_while(|l| l.trim().is_empty());
    let first = lines
        .next()
        .unwrap_or("bad arguments")
        .trim()
        .trim_start_matches("error: ")
        .trim_end_matches(':');
    let details: Vec<&str> = lines
        .take_while(|l| l.starts_with(' ') && !l.trim().is_empty())
        .map(str::trim)
        .collect();
    let details = if details.is_empty() {
        String::new()
    } else {
        format!(": {}", details.join(", "))
    };
    let tip = text
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("tip: "))
        .map(|t| format!(" ({t})"))
        .unwrap_or_default();
    format!("{first}{details}{tip} (see ferrocuda --help)")
}

/// Writes `text` to stdout; a write error is a failure, a closed pipe a quiet end.
fn emit(text: &str) -> Result<(), Failure> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(Failure::BrokenPipe),
        Err(e) => Err(Failure::Message(format!("cannot write to stdout: {e}"))),
    }
}

/// A line on stderr about what ran (never fatal).
fn note(text: &str) {
    let _ = writeln!(std::io::stderr(), "ferrocuda: {text}");
}

fn run(cli: Cli) -> Result<(), Failure> {
    let limits = match &cli.max_bytes {
        Some(text) => Limits::scaled(parse_max_bytes(text)?),
        None => Limits::DEFAULT,
    };
    match cli.command {
        Command::Replay {
            trace,
            confs,
            device,
            capacity,
            pytorch_figures,
            json,
            addresses,
            addresses_from,
            catch_up_every,
        } => {
            // Options first: a bad one is reported before the driver is initialised or any
            // file is read.
            let choice = choose_device(
                device == DeviceArg::Cuda,
                capacity.as_deref(),
                match (addresses, addresses_from) {
                    (_, Some(file)) => Some(AddressChoice::From(file)),
                    (Some(Addresses::Recorded), None) => Some(AddressChoice::Recorded),
                    (Some(Addresses::Fresh), None) => Some(AddressChoice::Fresh),
                    (None, None) => None,
                },
                catch_up_every,
            )?;
            let (confs, conf_note) = resolve_confs(&confs, |k| std::env::var(k))?;
            let device = Device::open(&choice)?;
            let options = ReplayOptions {
                limits,
                confs,
                conf_note,
                device,
                sidecar: pytorch_figures,
                json,
            };
            replay_command(&trace, options)
        }
        Command::Summary { snapshot } => {
            let recording = read_recording_within(&snapshot, &limits)?;
            emit(&summary(&recording))
        }
        Command::Plan {
            warmups,
            confs,
            free_outputs,
            json,
        } => plan_command(&warmups, &confs, free_outputs, json, &limits),
        Command::Plot { snapshot, output } => {
            let title = format!("ferrocuda memory: {}", snapshot.display());
            let page = plot_html(&read_recording_within(&snapshot, &limits)?, &title);
            std::fs::write(&output, &page)
                .map_err(|e| format!("cannot write {}: {e}", output.display()))?;
            // Say where the page went: a command that succeeds in silence leaves the user
            // looking for its output.
            eprintln!(
                "ferrocuda: wrote {} ({} bytes; open it in a browser)",
                output.display(),
                page.len()
            );
            Ok(())
        }
    }
}

fn plan_command(
    warmups: &[PathBuf],
    confs: &[String],
    free_outputs: bool,
    json: bool,
    limits: &Limits,
) -> Result<(), Failure> {
    let (confs, _) = resolve_confs(confs, |k| std::env::var(k))?;
    let mut captures = Vec::with_capacity(warmups.len());
    for path in warmups {
        let recording = read_recording_within(path, limits)?;
        let requests = graph_plan::requests_of(&recording)
            .map_err(|why| format!("{}: {why}", path.display()))?;
        captures.push(requests);
    }
    let names: Vec<String> = warmups.iter().map(|p| p.display().to_string()).collect();
    let mut text = String::new();
    let mut rows = Vec::new();
    for conf in &confs {
        let plan = graph_plan::plan(&conf.config, &captures, free_outputs)?;
        if json {
            rows.push(graph_plan::plan_json(&conf.label, &plan));
        } else {
            text += &graph_plan::plan_table(&conf.label, &names, &plan);
        }
    }
    if json {
        text = serde_json::to_string_pretty(&rows)? + "\n";
    }
    emit(&text)
}

fn progress_bar(total: u64) -> Option<indicatif::ProgressBar> {
    std::io::stderr().is_terminal().then(|| {
        let bar = indicatif::ProgressBar::new(total);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} events {per_sec}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar
    })
}

/// `replay`'s options, checked.
struct ReplayOptions {
    limits: Limits,
    confs: Vec<ferrocuda_cli::options::Conf>,
    /// Where the configurations came from.
    conf_note: String,
    device: Device,
    sidecar: Option<PathBuf>,
    json: bool,
}

fn replay_command(trace: &std::path::Path, options: ReplayOptions) -> Result<(), Failure> {
    let ReplayOptions {
        limits,
        confs,
        conf_note,
        device: target,
        sidecar,
        json,
    } = options;
    let recording = read_recording_within(trace, &limits)?;
    let devices: Vec<(u16, Vec<_>, Vec<u64>)> = recording
        .traces
        .iter()
        .enumerate()
        .filter(|(_, t)| !t.is_empty())
        .map(|(d, t)| Ok((u16::try_from(d)?, events(t), segment_addresses(t))))
        .collect::<Result<_, std::num::TryFromIntError>>()
        .map_err(|_| "more than 65536 device traces")?;
    if devices.is_empty() {
        return Err(Failure::Message(format!(
            "{}: no allocation history to replay (device_traces is {}; record it with \
             torch.cuda.memory._record_memory_history before taking the snapshot)",
            trace.display(),
            if recording.has_history {
                "empty"
            } else {
                "missing"
            }
        )));
    }
    let reference = pytorch::find(trace, &recording, sidecar.as_deref())?;
    let total: usize = devices.iter().map(|(_, e, _)| e.len()).sum();
    let bar = progress_bar((total * confs.len()) as u64);
    let mut columns = Vec::new();
    let mut done = 0u64;
    for (device, events, recorded) in &devices {
        for conf in &confs {
            let (mut figures, _) = target.replay(
                *device,
                events,
                recorded,
                &conf.label,
                conf.config.clone(),
                |n| {
                    if let Some(b) = &bar {
                        b.set_position(done + n);
                    }
                },
            )?;
            done += events.len() as u64;
            if *device == 0 {
                figures.pytorch = reference
                    .as_ref()
                    .and_then(|r| r.figures(&conf.config))
                    .cloned();
            }
            columns.push(figures);
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    // What ran goes to stderr after the figures are out, so a failure stays one line.
    if json {
        emit(&(serde_json::to_string_pretty(&columns)? + "\n"))?;
    } else {
        let text: Vec<String> = devices
            .iter()
            .map(|(d, _, _)| {
                let of_device: Vec<Figures> =
                    columns.iter().filter(|c| c.device == *d).cloned().collect();
                table(*d, devices.len() > 1, &of_device) + &recorded_segments(&recording, *d)
            })
            .collect();
        emit(&text.join("\n"))?;
    }
    note(&conf_note);
    note(&format!("replayed on {}", target.describe()));
    if devices.len() > 1 {
        let each = match target {
            Device::Cuda(_) => "on cuda:0 in turn, each with an allocator of its own",
            _ => "on a fake device of its own",
        };
        note(&format!(
            "the trace has {} devices: each device separately, {each}",
            devices.len()
        ));
    }
    if let Some(r) = &reference {
        note(&format!("PyTorch's figures from {}", r.source));
    }
    Ok(())
}

/// The recording's segments of `device` when the snapshot was taken, under the table.
fn recorded_segments(recording: &Recording, device: u16) -> String {
    let segments: Vec<_> = recording
        .segments
        .iter()
        .filter(|s| s.device == device)
        .collect();
    if segments.is_empty() {
        return String::new();
    }
    let reserved: u64 = segments.iter().map(|s| s.total_size).sum();
    let private = segments.iter().filter(|s| s.pool != (0, 0)).count();
    format!(
        "recording: {} segments ({private} in private pools), {} reserved when the snapshot \
         was taken\n",
        segments.len(),
        gib(reserved)
    )
}

fn gib(b: u64) -> String {
    format!("{:.3} GiB", b as f64 / (1u64 << 30) as f64)
}

/// PyTorch's figure against ours: `= ours`, `ours +217.0 KiB`, or `n/a`.
fn versus(theirs: Option<u64>, ours: u64) -> String {
    match theirs {
        None => "n/a".into(),
        Some(t) if t == ours => "= ours".into(),
        Some(t) if ours > t => format!("ours +{}", format_size(ours - t)),
        Some(t) => format!("ours -{}", format_size(t - ours)),
    }
}

fn count_versus(theirs: Option<u64>, ours: u64) -> String {
    match theirs {
        None => "n/a".into(),
        Some(t) if t == ours => "= ours".into(),
        Some(t) => format!("{t} (ours {ours})"),
    }
}

/// A table row: its name and how to print one configuration's figure.
type Row = (&'static str, fn(&Figures) -> String);

/// One column per configuration, for one device.
fn table(device: u16, heading: bool, columns: &[Figures]) -> String {
    let mut rows: Vec<Row> = vec![
        ("peak requested", |f| gib(f.peak_requested)),
        ("peak allocated", |f| gib(f.peak_allocated)),
        ("peak reserved", |f| gib(f.peak_reserved)),
        ("reserved/requested", |f| {
            format!("{:.4}", f.reserved_over_requested)
        }),
        ("device allocations", |f| f.num_device_alloc.to_string()),
        ("device frees", |f| f.num_device_free.to_string()),
        ("OOMs", |f| f.num_ooms.to_string()),
        ("events", |f| f.events.to_string()),
        ("alloc/free events timed", |f| f.timed_events.to_string()),
        ("ns per event", |f| format!("{:.1}", f.ns_per_event)),
    ];
    if columns.iter().any(|c| c.addresses.is_some()) {
        rows.push(("planned addresses used", |f| match f.addresses {
            Some(a) => format!("{} of {}, {} fresh", a.used, a.recorded, a.fresh),
            None => "-".into(),
        }));
    }
    if columns.iter().any(|c| c.pytorch.is_some()) {
        rows.extend::<[Row; 5]>([
            ("  PyTorch peak requested", |f| {
                versus(
                    f.pytorch.as_ref().and_then(|p| p.peak_requested),
                    f.peak_requested,
                )
            }),
            ("  PyTorch peak allocated", |f| {
                versus(
                    f.pytorch.as_ref().and_then(|p| p.peak_allocated),
                    f.peak_allocated,
                )
            }),
            ("  PyTorch peak reserved", |f| {
                versus(
                    f.pytorch.as_ref().and_then(|p| p.peak_reserved),
                    f.peak_reserved,
                )
            }),
            ("  PyTorch device allocs", |f| {
                count_versus(
                    f.pytorch.as_ref().and_then(|p| p.num_device_alloc),
                    f.num_device_alloc,
                )
            }),
            ("  PyTorch device frees", |f| {
                count_versus(
                    f.pytorch.as_ref().and_then(|p| p.num_device_free),
                    f.num_device_free,
                )
            }),
        ]);
    }
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|(_, cell)| columns.iter().map(cell).collect())
        .collect();
    let width = columns
        .iter()
        .map(|c| c.conf.chars().count())
        .chain(cells.iter().flatten().map(|c| c.chars().count()))
        .max()
        .unwrap_or(0)
        .max(14);
    let title = if heading {
        format!("cuda:{device}")
    } else {
        String::new()
    };
    let mut out = format!("{title:26}");
    for c in columns {
        out += &format!(" | {:>width$}", c.conf);
    }
    out.push('\n');
    for ((name, _), row) in rows.iter().zip(&cells) {
        out += &format!("{name:26}");
        for cell in row {
            out += &format!(" | {cell:>width$}");
        }
        out.push('\n');
    }
    out
}

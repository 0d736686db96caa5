//! `ferrocuda`: replay PyTorch allocation traces through ferrocuda's allocator.
#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};
use ferrocuda_cli::replay::{Figures, replay};
use ferrocuda_cli::report::{plot_html, summary};
use ferrocuda_cli::trace::{read_device_traces, read_snapshot};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "ferrocuda",
    version,
    about = "ferrocuda tools: replay PyTorch allocation traces"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replays a PyTorch memory snapshot's device traces through ferrocuda's allocator on the
    /// fake device, once per --conf, and prints the figures side by side.
    Replay {
        /// A snapshot from torch.cuda.memory._snapshot() (pickle, optionally .xz or .gz).
        trace: PathBuf,
        /// An allocator configuration (PYTORCH_CUDA_ALLOC_CONF grammar); repeat for columns.
        /// Default: ferrocuda's default configuration.
        #[arg(long = "conf")]
        confs: Vec<String>,
        /// Memory of the fake device, in GiB.
        #[arg(long, default_value_t = 80)]
        capacity: u64,
        /// Print a JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Prints PyTorch's memory_summary table for a snapshot (current state from its
    /// segments, peaks of requested and reserved bytes from its history).
    Summary {
        /// A snapshot (pickle, optionally .xz or .gz).
        snapshot: PathBuf,
    },
    /// Writes a self-contained HTML page with the memory timeline and the largest blocks.
    Plot {
        /// A snapshot (pickle, optionally .xz or .gz).
        snapshot: PathBuf,
        /// The page to write.
        #[arg(short = 'o', long = "output")]
        output: PathBuf,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferrocuda: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    match cli.command {
        Command::Replay {
            trace,
            confs,
            capacity,
            json,
        } => {
            let traces = read_device_traces(&trace)?;
            let events: Vec<_> = traces.into_iter().flatten().collect();
            let confs = if confs.is_empty() {
                vec![String::new()]
            } else {
                confs
            };
            let bar = std::io::stderr().is_terminal().then(|| {
                let bar = indicatif::ProgressBar::new((events.len() * confs.len()) as u64);
                bar.set_style(
                    indicatif::ProgressStyle::with_template(
                        "{bar:40} {pos}/{len} events {per_sec}",
                    )
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
                );
                bar
            });
            let mut columns = Vec::new();
            for (i, conf) in confs.iter().enumerate() {
                let base = (i * events.len()) as u64;
                let (figures, _) = replay(&events, conf, capacity << 30, |done| {
                    if let Some(b) = &bar {
                        b.set_position(base + done);
                    }
                })?;
                columns.push(figures);
            }
            if let Some(b) = bar {
                b.finish_and_clear();
            }
            if json {
                println!("{}", serde_json::to_string_pretty(&columns)?);
            } else {
                print!("{}", table(&columns));
            }
            Ok(())
        }
        Command::Summary { snapshot } => {
            print!("{}", summary(&read_snapshot(&snapshot)?));
            Ok(())
        }
        Command::Plot { snapshot, output } => {
            let title = format!("ferrocuda memory: {}", snapshot.display());
            std::fs::write(&output, plot_html(&read_snapshot(&snapshot)?, &title))
                .map_err(|e| format!("cannot write {}: {e}", output.display()))?;
            Ok(())
        }
    }
}

fn gib(b: u64) -> String {
    format!("{:.3} GiB", b as f64 / (1u64 << 30) as f64)
}

/// A table row: its name and how to print one configuration's figure.
type Row = (&'static str, fn(&Figures) -> String);

/// One column per configuration.
fn table(columns: &[Figures]) -> String {
    let rows: [Row; 9] = [
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
        ("events per second", |f| {
            format!("{:.2e}", f.events as f64 / f.seconds.max(1e-9))
        }),
    ];
    let width = columns
        .iter()
        .map(|c| c.conf.len())
        .max()
        .unwrap_or(0)
        .max(14);
    let mut out = format!("{:20}", "");
    for c in columns {
        out += &format!(" | {:>width$}", c.conf);
    }
    out.push('\n');
    for (name, cell) in rows {
        out += &format!("{name:20}");
        for c in columns {
            out += &format!(" | {:>width$}", cell(c));
        }
        out.push('\n');
    }
    out
}

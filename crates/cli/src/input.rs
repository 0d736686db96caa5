//! Opening a snapshot file as a stream of pickle bytes: `.xz` (concatenated streams too, as
//! Python's `lzma.open` reads them), `.gz` (multi-member, as Python's `gzip.open`), or a
//! plain pickle, told apart by their first bytes, never by the file's name. Nothing is
//! decompressed ahead of the reader, and the decompressed bytes are counted as they are read:
//! past [`Limits::max_bytes`] the read fails, so a small file that expands to gigabytes ends
//! with one error, not an exhausted memory.
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::os::unix::fs::FileTypeExt;
use std::path::Path;

/// Bounds on what reading one snapshot may take. A snapshot of two million events is about
/// 70 MB of pickle; the defaults leave room for fifteen times that.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Decompressed pickle bytes read at most.
    pub max_bytes: u64,
    /// Bytes of distinct strings kept at most (a string referred to again through the
    /// pickle's memo is kept once and counted once).
    pub max_string_bytes: u64,
    /// Values held at most: container items, memo entries and the machine's stack. Each
    /// takes 16 bytes, so this bounds the memory the decoded structure takes.
    pub max_values: u64,
}

impl Limits {
    /// The defaults: 1 GiB of pickle, 512 MiB of strings, 64 Mi values (1 GiB).
    pub const DEFAULT: Limits = Limits::scaled(1 << 30);

    /// Limits for `max_bytes` of pickle: strings up to half of it, values up to a
    /// sixteenth of it in number (as many bytes as the pickle has, at 16 bytes a value).
    pub const fn scaled(max_bytes: u64) -> Limits {
        Limits {
            max_bytes,
            max_string_bytes: max_bytes / 2,
            max_values: max_bytes / 16,
        }
    }
}

impl Default for Limits {
    fn default() -> Limits {
        Limits::DEFAULT
    }
}

/// Why a file could not be opened or read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InputError {
    /// The file could not be opened or read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: io::Error,
    },
    /// The path names a directory or a device, not a file or a pipe.
    #[error("cannot read {path}: not a regular file or a pipe")]
    NotAFile {
        /// The path.
        path: String,
    },
}

/// A reader that fails once more than `left` bytes have come through it.
#[derive(Debug)]
pub struct Capped<R> {
    inner: R,
    left: u64,
    limit: u64,
}

/// The error a [`Capped`] reader returns past its limit (inside an `io::Error` of kind
/// `Other`): the reader names the limit and the option that raises it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("more than {limit} bytes of pickle once decompressed (raise the limit with --max-bytes)")]
pub struct TooLarge {
    /// The limit, in bytes.
    pub limit: u64,
}

impl<R: Read> Read for Capped<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            // One byte more than allowed means the input is over the limit; none means it
            // ended exactly at it.
            let mut probe = [0u8; 1];
            return match self.inner.read(&mut probe)? {
                0 => Ok(0),
                _ => Err(io::Error::other(TooLarge { limit: self.limit })),
            };
        }
        let want = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        self.left -= n as u64;
        Ok(n)
    }
}

/// What the first bytes say a file is.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Container {
    Xz,
    Gzip,
    Plain,
}

fn sniff(head: &[u8]) -> Container {
    if head.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0]) {
        Container::Xz
    } else if head.starts_with(&[0x1f, 0x8b]) {
        Container::Gzip
    } else {
        Container::Plain
    }
}

/// Opens `path` for reading as pickle bytes, decompressing as its first bytes say, with at
/// most `limits.max_bytes` bytes to come out of it.
pub fn open(path: &Path, limits: &Limits) -> Result<Capped<Box<dyn BufRead>>, InputError> {
    let name = || path.display().to_string();
    let io_error = |source| InputError::Io {
        path: name(),
        source,
    };
    let file = File::open(path).map_err(io_error)?;
    let meta = file.metadata().map_err(io_error)?;
    // A pipe (`<(xz -dc file)`) is a stream like a file; a directory or a device
    // (`/dev/zero`) is not a snapshot.
    if !(meta.is_file() || meta.file_type().is_fifo()) {
        return Err(InputError::NotAFile { path: name() });
    }
    let mut raw = BufReader::with_capacity(1 << 16, file);
    let kind = sniff(raw.fill_buf().map_err(io_error)?);
    let inner: Box<dyn BufRead> = match kind {
        Container::Xz => Box::new(BufReader::with_capacity(
            1 << 16,
            liblzma::read::XzDecoder::new_multi_decoder(raw),
        )),
        Container::Gzip => Box::new(BufReader::with_capacity(
            1 << 16,
            flate2::bufread::MultiGzDecoder::new(raw),
        )),
        Container::Plain => Box::new(raw),
    };
    Ok(Capped {
        inner,
        left: limits.max_bytes,
        limit: limits.max_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("ferrocuda-input-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        dir.join(name)
    }

    fn read_all(path: &Path, limits: &Limits) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        open(path, limits)
            .map_err(|e| e.to_string())?
            .read_to_end(&mut out)
            .map_err(|e| e.to_string())?;
        Ok(out)
    }

    #[test]
    fn concatenated_xz_streams_and_gzip_members_read_as_python_reads_them() {
        let text = b"pickle bytes, twice";
        let mut xz = Vec::new();
        for _ in 0..2 {
            let mut enc = liblzma::write::XzEncoder::new(Vec::new(), 1);
            let _ = enc.write_all(text);
            xz.extend(enc.finish().unwrap_or_default());
        }
        let path = scratch("two.xz");
        let _ = std::fs::write(&path, &xz);
        assert_eq!(read_all(&path, &Limits::DEFAULT), Ok(text.repeat(2)));
        let mut gz = Vec::new();
        for _ in 0..2 {
            let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            let _ = enc.write_all(text);
            gz.extend(enc.finish().unwrap_or_default());
        }
        let path = scratch("two.gz");
        let _ = std::fs::write(&path, &gz);
        assert_eq!(read_all(&path, &Limits::DEFAULT), Ok(text.repeat(2)));
    }

    #[test]
    fn the_cap_counts_decompressed_bytes_and_a_directory_is_refused() {
        let mut enc = liblzma::write::XzEncoder::new(Vec::new(), 6);
        let _ = enc.write_all(&vec![0u8; 10 << 20]);
        let path = scratch("zeros.xz");
        let _ = std::fs::write(&path, enc.finish().unwrap_or_default());
        let err = read_all(&path, &Limits::scaled(1 << 20))
            .err()
            .unwrap_or_default();
        assert!(err.contains("more than 1048576 bytes"), "{err}");
        assert!(err.contains("--max-bytes"), "{err}");
        // Exactly at the limit is allowed.
        assert_eq!(
            read_all(&path, &Limits::scaled(10 << 20)).map(|b| b.len()),
            Ok(10 << 20)
        );
        let dir = std::env::temp_dir();
        let err = read_all(&dir, &Limits::DEFAULT).err().unwrap_or_default();
        assert!(err.contains("not a regular file"), "{err}");
        let err = read_all(Path::new("/dev/zero"), &Limits::DEFAULT)
            .err()
            .unwrap_or_default();
        assert!(err.contains("not a regular file"), "{err}");
    }
}

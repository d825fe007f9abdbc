//! The base run's log-probabilities on disk (`eval --kl-base FILE`, like llama-perplexity's
//! `--kl-divergence-base`): written once, read back by later evaluations of the same
//! windows instead of running the fp16 reference again.
//!
//! | bytes          | content                                                          |
//! |----------------|------------------------------------------------------------------|
//! | 8              | magic `VQKLBASE`                                                 |
//! | 4 × 6 (u32 LE) | version (1), n_ctx, n_windows, first scored position, n_vocab, scored per window |
//! | 8 (u64 LE)     | FNV-1a hash of the evaluated tokens (and the BOS substitution)   |
//! | rows           | per scored position: f32 min, f32 max, u32 argmax, f32 log p of the target, |
//! |                | then n_vocab u16 LE: log p ≈ min + q·(max − min)/65535           |
//!
//! Linear 16-bit steps over each row's range (≤ 30 nats here: ≤ 2.3·10⁻⁴ nats per step,
//! well below the KL differences reported); the target's log-prob (so the base PPL and Δp)
//! and the top token (a near-tie could otherwise flip) are kept exactly. The file is written to `FILE.tmp` and renamed
//! when complete; a reader checks the header against the run and the file's exact size
//! before reading a row.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use crate::error::{LlmError, Result};

const MAGIC: &[u8; 8] = b"VQKLBASE";
const VERSION: u32 = 1;
const HEADER_BYTES: u64 = 8 + 6 * 4 + 8;
/// Vocabularies above this are refused (bounds a row's allocation).
const MAX_VOCAB: u32 = 1 << 22;

/// What a base file is for: the windows and the tokens they hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KlBaseHeader {
    pub n_ctx: u32,
    pub n_windows: u32,
    pub first: u32,
    pub n_vocab: u32,
    pub scored: u32,
    pub tokens_hash: u64,
}

impl KlBaseHeader {
    /// FNV-1a over the token ids (and the BOS that replaces each window's first token).
    pub fn hash_tokens(tokens: &[u32], bos: Option<u32>) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in bos.map_or([0xff; 5], |b| {
            let x = b.to_le_bytes();
            [1, x[0], x[1], x[2], x[3]]
        }) {
            h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
        for t in tokens {
            for b in t.to_le_bytes() {
                h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
            }
        }
        h
    }

    fn row_bytes(&self) -> u64 {
        16 + 2 * self.n_vocab as u64
    }

    fn file_bytes(&self) -> Option<u64> {
        let rows = (self.n_windows as u64).checked_mul(self.scored as u64)?;
        rows.checked_mul(self.row_bytes())?.checked_add(HEADER_BYTES)
    }

    fn to_bytes(self) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        for v in [VERSION, self.n_ctx, self.n_windows, self.first, self.n_vocab, self.scored] {
            out.extend(v.to_le_bytes());
        }
        out.extend(self.tokens_hash.to_le_bytes());
        out
    }
}

fn io(path: &Path, e: std::io::Error) -> LlmError {
    LlmError::InvalidArgument(format!("kl-base {}: {e}", path.display()))
}

/// Writes the rows of every window in order; [`finish`](Self::finish) renames it into place.
pub struct KlBaseWriter {
    path: PathBuf,
    tmp: PathBuf,
    w: BufWriter<File>,
    header: KlBaseHeader,
    rows: u64,
}

impl KlBaseWriter {
    pub fn create(path: &Path, header: KlBaseHeader) -> Result<Self> {
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let mut w = BufWriter::new(File::create(&tmp).map_err(|e| io(&tmp, e))?);
        w.write_all(&header.to_bytes()).map_err(|e| io(&tmp, e))?;
        Ok(Self { path: path.to_path_buf(), tmp, w, header, rows: 0 })
    }

    /// One window's log-prob rows (`scored × n_vocab`) and each row's target token.
    pub fn write_window(&mut self, rows: &[f32], targets: &[usize]) -> Result<()> {
        let v = self.header.n_vocab as usize;
        let n = self.header.scored as usize;
        if rows.len() != n * v || targets.len() != n || targets.iter().any(|&t| t >= v) {
            return Err(LlmError::ShapeMismatch { op: "kl-base window", expected: n * v, got: rows.len() });
        }
        let mut buf = Vec::with_capacity(self.header.row_bytes() as usize);
        for (row, &target) in rows.chunks_exact(v).zip(targets) {
            let (lo, hi) = row.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
            let step = (hi - lo) / 65535.0;
            buf.clear();
            buf.extend(lo.to_le_bytes());
            buf.extend(hi.to_le_bytes());
            buf.extend((crate::eval::argmax(row) as u32).to_le_bytes());
            buf.extend(row[target].to_le_bytes());
            for &x in row {
                let q = if step > 0.0 { ((x - lo) / step).round().clamp(0.0, 65535.0) as u16 } else { 0 };
                buf.extend(q.to_le_bytes());
            }
            self.w.write_all(&buf).map_err(|e| io(&self.tmp, e))?;
            self.rows += 1;
        }
        Ok(())
    }

    /// Flush, check every row was written, and move the file to its name.
    pub fn finish(mut self) -> Result<()> {
        self.w.flush().map_err(|e| io(&self.tmp, e))?;
        let want = self.header.n_windows as u64 * self.header.scored as u64;
        if self.rows != want {
            return Err(LlmError::InvalidArgument(format!("kl-base: {} of {want} rows written", self.rows)));
        }
        drop(self.w);
        std::fs::rename(&self.tmp, &self.path).map_err(|e| io(&self.path, e))
    }
}

/// Reads a base file written for exactly this run, window by window.
pub struct KlBaseReader {
    r: BufReader<File>,
    header: KlBaseHeader,
}

impl KlBaseReader {
    /// Opens `path` if it holds the base of `want`; a file for other windows, tokens or
    /// vocabulary, or of the wrong size, is an error naming what differs.
    pub fn open(path: &Path, want: KlBaseHeader) -> Result<Self> {
        let f = File::open(path).map_err(|e| io(path, e))?;
        let size = f.metadata().map_err(|e| io(path, e))?.len();
        let mut r = BufReader::new(f);
        let mut head = [0u8; HEADER_BYTES as usize];
        r.read_exact(&mut head).map_err(|e| io(path, e))?;
        let bad = |why: String| LlmError::InvalidArgument(format!("kl-base {}: {why}", path.display()));
        if &head[..8] != MAGIC {
            return Err(bad("not a kl-base file".into()));
        }
        let u = |i: usize| u32::from_le_bytes(head[8 + 4 * i..12 + 4 * i].try_into().expect("4 bytes"));
        if u(0) != VERSION {
            return Err(bad(format!("version {} (this build reads {VERSION})", u(0))));
        }
        let got = KlBaseHeader {
            n_ctx: u(1),
            n_windows: u(2),
            first: u(3),
            n_vocab: u(4),
            scored: u(5),
            tokens_hash: u64::from_le_bytes(head[32..40].try_into().expect("8 bytes")),
        };
        if got != want {
            return Err(bad(format!("written for {got:?}, this run is {want:?}")));
        }
        if got.n_vocab > MAX_VOCAB || got.file_bytes() != Some(size) {
            return Err(bad(format!("{size} bytes, the header implies {:?}", got.file_bytes())));
        }
        Ok(Self { r, header: got })
    }

    /// The next window: its rows (`scored × n_vocab` log-probs, each target's entry exact)
    /// and each row's top token. `targets` must be the ones the rows were written with.
    pub fn read_window(&mut self, targets: &[usize]) -> Result<(Vec<f32>, Vec<usize>)> {
        let (v, n) = (self.header.n_vocab as usize, self.header.scored as usize);
        if targets.len() != n || targets.iter().any(|&t| t >= v) {
            return Err(LlmError::ShapeMismatch { op: "kl-base targets", expected: n, got: targets.len() });
        }
        let mut out = Vec::with_capacity(n * v);
        let mut tops = Vec::with_capacity(n);
        let mut buf = vec![0u8; self.header.row_bytes() as usize];
        let f = |b: &[u8]| f32::from_le_bytes(b.try_into().expect("4 bytes"));
        for &target in targets {
            self.r.read_exact(&mut buf).map_err(|e| LlmError::InvalidArgument(format!("kl-base row: {e}")))?;
            let (lo, hi, lp) = (f(&buf[0..4]), f(&buf[4..8]), f(&buf[12..16]));
            let top = u32::from_le_bytes(buf[8..12].try_into().expect("4 bytes")) as usize;
            if !(lo.is_finite() && hi.is_finite() && lp.is_finite()) || top >= v {
                return Err(LlmError::InvalidArgument("kl-base row: bad header".into()));
            }
            let step = (hi - lo) / 65535.0;
            let at = out.len();
            out.extend(buf[16..].chunks_exact(2).map(|q| lo + u16::from_le_bytes([q[0], q[1]]) as f32 * step));
            out[at + target] = lp;
            tops.push(top);
        }
        Ok((out, tops))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(n_vocab: u32) -> KlBaseHeader {
        KlBaseHeader {
            n_ctx: 8,
            n_windows: 2,
            first: 4,
            n_vocab,
            scored: 3,
            tokens_hash: KlBaseHeader::hash_tokens(&[1, 2, 3], None),
        }
    }

    #[test]
    fn rows_round_trip_within_one_step_and_mismatches_are_refused() {
        let dir = std::env::temp_dir().join(format!("vq-klbase-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("base.bin");
        let h = header(5);
        let rows: Vec<f32> = crate::test_util::pseudo(2 * 3 * 5, 9).iter().map(|v| -10.0 * v.abs()).collect();
        let targets = [1usize, 4, 0];
        let mut w = KlBaseWriter::create(&path, h).unwrap();
        w.write_window(&rows[..15], &targets).unwrap();
        assert!(w.write_window(&rows[..14], &targets).is_err());
        assert!(w.write_window(&rows[15..], &[1, 5, 0]).is_err(), "target outside the vocabulary");
        w.write_window(&rows[15..], &targets).unwrap();
        w.finish().unwrap();
        let mut r = KlBaseReader::open(&path, h).unwrap();
        let (a, ta) = r.read_window(&targets).unwrap();
        let (b, tb) = r.read_window(&targets).unwrap();
        let (back, tops) = ([a, b].concat(), [ta, tb].concat());
        for (i, (row, got)) in rows.chunks(5).zip(back.chunks(5)).enumerate() {
            let (lo, hi) = row.iter().fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
            for (a, b) in row.iter().zip(got) {
                assert!((a - b).abs() <= (hi - lo) / 65535.0, "{a} vs {b}");
            }
            assert_eq!(got[targets[i % 3]], row[targets[i % 3]], "the target's log-prob is exact");
            assert_eq!(tops[i], crate::eval::argmax(row));
        }
        // Another run's windows or tokens, a truncated file, not a base file at all.
        assert!(KlBaseReader::open(&path, KlBaseHeader { n_windows: 3, ..h }).is_err());
        assert!(KlBaseReader::open(&path, KlBaseHeader { tokens_hash: 7, ..h }).is_err());
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
        assert!(KlBaseReader::open(&path, h).is_err());
        std::fs::write(&path, b"something else entirely, long enough to hold a header").unwrap();
        assert!(KlBaseReader::open(&path, h).is_err());
        // An unfinished writer leaves only its .tmp file.
        let p2 = dir.join("partial.bin");
        let mut w = KlBaseWriter::create(&p2, h).unwrap();
        w.write_window(&rows[..15], &targets).unwrap();
        assert!(w.finish().is_err());
        assert!(!p2.exists());
        assert_ne!(KlBaseHeader::hash_tokens(&[1, 2, 3], Some(0)), KlBaseHeader::hash_tokens(&[1, 2, 3], None));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

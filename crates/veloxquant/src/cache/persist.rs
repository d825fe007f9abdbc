//! Saving and loading a whole cache as one safetensors file (format version 2; version 1
//! files load too).
//!
//! Layout: the safetensors framing (u64 LE header length, JSON header, raw tensor bytes).
//! `__metadata__` holds `format` = "veloxquant-cache", `version`, `config` (JSON: shape of
//! the model — layers, KV heads, head size — page size, window, sinks, K/V specs, seed, and
//! per layer the token, page, open-row, tail and sink counts; since version 2 optionally
//! `layer_specs`, the K and V spec of every layer of a per-layer cache), `model` (an optional
//! fingerprint string of the model, e.g. its file hash), `user.*` strings of the caller,
//! and `crc32` over every other metadata entry (sorted, `key\0value\0`) then the payload,
//! so no flipped byte of the config or the data goes unnoticed. Tensors, in payload order, per layer L and stream
//! s ∈ {k, v}: `lL.s.pages` U8 [H, P, page_bytes] (codes in the canonical layout),
//! `lL.s.sink` and `lL.s.tail` F16 [H, n, d]; then `lL.hH.s.state` F32 for formats with
//! trained state (vecinfer codebooks). Rotations are not stored: they are derived from the
//! seed, as at build time.
//!
//! Loading checks the framing, version, fingerprint and every tensor's name, type and
//! shape against the config before reading the payload; reads the payload in bounded chunks
//! (a declared size is never allocated up front, so a truncated or lying file cannot make it
//! allocate more than it holds); verifies the checksum; and only then builds the cache,
//! checking each stream's invariants. Save and load stream through `Write`/`Read` with no
//! second copy of the cache.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::sync::Arc;

use half::f16;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;
use serde::{Deserialize, Serialize};

use super::stream::StreamParts;
use super::{CacheConfig, LayerCache, LayerSpec, Page, PagedCache, StreamStore};
use crate::error::{Result, VqError};
use crate::format::{FormatSpec, Stream};

/// The cache file version this build writes.
pub const FILE_VERSION: u32 = 2;
/// The versions it reads: 1 (one K and one V spec for every layer) and 2 (adds optional
/// per-layer specs; otherwise the same layout).
pub const FILE_VERSIONS_READ: &[u32] = &[1, 2];
const FILE_KIND: &str = "veloxquant-cache";
/// Headers above this are refused before reading them (a real one is a few KiB per layer).
const MAX_HEADER_BYTES: u64 = 16 << 20;
/// Read granularity: memory grows with the bytes actually received, never the declared size.
const CHUNK: usize = 1 << 16;
// Sanity bounds on declared dimensions: the ones `CacheConfig::validate` enforces.
use super::{MAX_HEADS, MAX_LAYERS};
use crate::format::{MAX_HEAD_DIM, MAX_PAGE_TOKENS};
/// Memory the header may make the loader build (format state, tail and sink buffers) beyond
/// what the payload pays for: a few bytes of header must not declare gigabytes of structure.
const STRUCTURE_ALLOWANCE: usize = 64 << 20;
const STRUCTURE_PER_PAYLOAD_BYTE: usize = 32;

/// What a save records besides the cache: the model fingerprint and caller strings
/// (e.g. the token ids of the prompt, to continue generating after a load).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SaveInfo {
    pub model: Option<String>,
    pub user: BTreeMap<String, String>,
}

/// What a load must find; `None` accepts anything. A mismatch is [`VqError::FileMismatch`].
#[derive(Clone, Debug, Default)]
pub struct LoadCheck {
    pub n_layers: Option<usize>,
    pub n_kv_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub model: Option<String>,
}

#[derive(Serialize, Deserialize, Debug)]
struct SavedConfig {
    n_layers: usize,
    n_kv_heads: usize,
    head_dim: usize,
    page_tokens: usize,
    recent: usize,
    sink: usize,
    k: String,
    v: String,
    seed: u64,
    encode_rows: bool,
    row_mode: bool,
    layers: Vec<SavedLayer>,
    /// Version 2: [K spec, V spec] per layer when the cache has per-layer formats.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    layer_specs: Option<Vec<[String; 2]>>,
}

#[derive(Serialize, Deserialize, Debug, Clone, Copy)]
struct SavedLayer {
    n_tokens: usize,
    /// Per stream (K, V): pages, open rows, tail tokens, sink tokens.
    k: SavedStream,
    v: SavedStream,
}

#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
struct SavedStream {
    pages: usize,
    open_rows: usize,
    tail: usize,
    sink: usize,
}

/// Exported trained state per (layer, head, stream), for the formats that have one.
type TrainedStates = HashMap<(usize, usize, Stream), Vec<f32>>;

/// One tensor of the payload and where its bytes come from / go to.
#[derive(Clone, Copy, Debug)]
enum Part {
    Pages(usize, Stream),
    Sink(usize, Stream),
    Tail(usize, Stream),
    State(usize, usize, Stream),
}

fn stream_tag(s: Stream) -> &'static str {
    match s {
        Stream::Keys => "k",
        Stream::Values => "v",
    }
}

impl Part {
    fn name(self) -> String {
        match self {
            Part::Pages(l, s) => format!("l{l}.{}.pages", stream_tag(s)),
            Part::Sink(l, s) => format!("l{l}.{}.sink", stream_tag(s)),
            Part::Tail(l, s) => format!("l{l}.{}.tail", stream_tag(s)),
            Part::State(l, h, s) => format!("l{l}.h{h}.{}.state", stream_tag(s)),
        }
    }
}

/// The payload's tensors in order: per layer its six stream tensors, then the trained
/// states `(layer, head, stream)` in that order.
fn plan(n_layers: usize, states: impl IntoIterator<Item = (usize, usize, Stream)>) -> Vec<Part> {
    let mut parts = Vec::new();
    for l in 0..n_layers {
        for s in [Stream::Keys, Stream::Values] {
            parts.extend([Part::Pages(l, s), Part::Sink(l, s), Part::Tail(l, s)]);
        }
    }
    parts.extend(states.into_iter().map(|(l, h, s)| Part::State(l, h, s)));
    parts
}

/// `lL.hH.s.state` → (L, H, s).
fn parse_state_name(name: &str) -> Option<(usize, usize, Stream)> {
    let mut it = name.strip_suffix(".state")?.split('.');
    let l = it.next()?.strip_prefix('l')?.parse().ok()?;
    let h = it.next()?.strip_prefix('h')?.parse().ok()?;
    let s = match it.next()? {
        "k" => Stream::Keys,
        "v" => Stream::Values,
        _ => return None,
    };
    it.next().is_none().then_some((l, h, s))
}

impl PagedCache {
    fn stream(&self, l: usize, h: usize, s: Stream) -> &StreamStore {
        let lc = &self.layers[l];
        match s {
            Stream::Keys => &lc.keys[h],
            Stream::Values => &lc.values[h],
        }
    }

    fn saved_stream(&self, l: usize, s: Stream) -> Result<SavedStream> {
        let of = |st: &StreamStore| SavedStream {
            pages: st.pages().len(),
            open_rows: st.open_rows(),
            tail: st.tail_tokens(),
            sink: st.sink_tokens(),
        };
        let first = of(self.stream(l, 0, s));
        if (1..self.cfg.n_kv_heads).any(|h| of(self.stream(l, h, s)) != first) {
            return Err(VqError::InvalidConfig(format!("layer {l}: heads hold different token splits")));
        }
        Ok(first)
    }

    fn part_shape(&self, part: Part, states: &TrainedStates) -> (Dtype, Vec<usize>) {
        let (h, d) = (self.cfg.n_kv_heads, self.cfg.head_dim);
        match part {
            Part::Pages(l, s) => {
                let st = self.stream(l, 0, s);
                (Dtype::U8, vec![h, st.pages().len(), st.format().page_bytes()])
            }
            Part::Sink(l, s) => (Dtype::F16, vec![h, self.stream(l, 0, s).sink_tokens(), d]),
            Part::Tail(l, s) => (Dtype::F16, vec![h, self.stream(l, 0, s).tail_tokens(), d]),
            Part::State(l, hh, s) => (Dtype::F32, vec![states[&(l, hh, s)].len()]),
        }
    }

    /// Feed every byte of one tensor, in file order, to `sink`.
    fn emit(&self, part: Part, states: &TrainedStates, sink: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
        let heads = 0..self.cfg.n_kv_heads;
        match part {
            Part::Pages(l, s) => {
                for h in heads {
                    for p in self.stream(l, h, s).pages() {
                        sink(p)?;
                    }
                }
            }
            Part::Sink(l, s) => heads.into_iter().try_for_each(|h| emit_f16(self.stream(l, h, s).sink(), sink))?,
            Part::Tail(l, s) => heads.into_iter().try_for_each(|h| emit_f16(self.stream(l, h, s).tail(), sink))?,
            Part::State(l, h, s) => {
                for c in states[&(l, h, s)].chunks(CHUNK / 4) {
                    let bytes: Vec<u8> = c.iter().flat_map(|v| v.to_le_bytes()).collect();
                    sink(&bytes)?;
                }
            }
        }
        Ok(())
    }

    /// Write the whole cache (all layers, pages, fp16 tails and sinks, specs, seed, trained
    /// state) to `w` in the documented format; returns the bytes written. Streams: the
    /// payload is read from the cache twice (checksum, then write), never copied.
    pub fn save<W: Write>(&self, w: &mut W, info: &SaveInfo) -> Result<u64> {
        let cfg = &self.cfg;
        let layers = (0..cfg.n_layers)
            .map(|l| {
                Ok(SavedLayer {
                    n_tokens: self.layers[l].n_tokens,
                    k: self.saved_stream(l, Stream::Keys)?,
                    v: self.saved_stream(l, Stream::Values)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let saved = SavedConfig {
            n_layers: cfg.n_layers,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            page_tokens: cfg.page_tokens,
            recent: cfg.recent,
            sink: cfg.sink,
            k: cfg.k.to_string(),
            v: cfg.v.to_string(),
            seed: cfg.seed,
            encode_rows: cfg.encode_rows,
            row_mode: self.row_mode,
            layers,
            layer_specs: cfg.layers.as_ref().map(|ls| ls.iter().map(|l| [l.k.to_string(), l.v.to_string()]).collect()),
        };
        // Trained state, exported once (a copy of the codebooks) for the table and both passes.
        let ordered: Vec<_> = (0..cfg.n_layers)
            .flat_map(|l| (0..cfg.n_kv_heads).flat_map(move |h| [Stream::Keys, Stream::Values].map(|s| (l, h, s))))
            .map(|key| (key, self.stream(key.0, key.1, key.2).format().export_state()))
            .filter(|(_, state)| !state.is_empty())
            .collect();
        let parts = plan(cfg.n_layers, ordered.iter().map(|(key, _)| *key));
        let states: TrainedStates = ordered.into_iter().collect();

        let mut meta = HashMap::new();
        meta.insert("format".to_string(), FILE_KIND.to_string());
        meta.insert("version".to_string(), FILE_VERSION.to_string());
        meta.insert("config".to_string(), serde_json::to_string(&saved).map_err(|e| corrupt("config", e))?);
        if let Some(m) = &info.model {
            meta.insert("model".to_string(), m.clone());
        }
        for (k, v) in &info.user {
            meta.insert(format!("user.{k}"), v.clone());
        }
        let mut crc = metadata_crc(&meta);
        let mut tensors = Vec::with_capacity(parts.len());
        let mut offset = 0usize;
        for &part in &parts {
            let (dtype, shape) = self.part_shape(part, &states);
            let start = offset;
            self.emit(part, &states, &mut |b| {
                crc.update(b);
                offset += b.len();
                Ok(())
            })?;
            tensors.push((part.name(), TensorInfo { dtype, shape, data_offsets: (start, offset) }));
        }
        meta.insert("crc32".to_string(), format!("{:08x}", crc.finalize()));
        let metadata = Metadata::new(Some(meta), tensors).map_err(|e| corrupt("tensor table", e))?;
        let mut header = serde_json::to_vec(&metadata).map_err(|e| corrupt("header", e))?;
        header.resize(header.len().next_multiple_of(8), b' ');

        let io = |e: std::io::Error| VqError::io("writing a cache file", &e);
        w.write_all(&(header.len() as u64).to_le_bytes()).map_err(io)?;
        w.write_all(&header).map_err(io)?;
        for &part in &parts {
            self.emit(part, &states, &mut |b| w.write_all(b).map_err(io))?;
        }
        w.flush().map_err(io)?;
        Ok(8 + header.len() as u64 + offset as u64)
    }

    /// Read a cache written by [`save`](Self::save), verifying framing, version, `check`,
    /// every tensor's shape and the checksum before any byte is used. Reads exactly the
    /// file's bytes from `r` (what follows, on a socket say, is left unread).
    pub fn load<R: Read>(r: &mut R, check: &LoadCheck) -> Result<(PagedCache, SaveInfo)> {
        let mut len = [0u8; 8];
        read_full(r, &mut len, "header length")?;
        let n = u64::from_le_bytes(len);
        if n > MAX_HEADER_BYTES {
            return Err(VqError::FileCorrupt(format!("header length {n} exceeds {MAX_HEADER_BYTES}")));
        }
        let header = read_bounded(r, n as usize, "header")?;
        let metadata: Metadata = serde_json::from_slice(&header).map_err(|e| corrupt("header", e))?;
        let meta = metadata.metadata().clone().unwrap_or_default();
        let get = |k: &str| meta.get(k).ok_or_else(|| VqError::FileCorrupt(format!("header lacks {k:?}")));
        if get("format")? != FILE_KIND {
            return Err(VqError::FileCorrupt(format!("not a {FILE_KIND} file (format {:?})", get("format")?)));
        }
        let version = get("version")?;
        let v = version.parse::<u32>().ok().filter(|v| FILE_VERSIONS_READ.contains(v));
        let v = v.ok_or_else(|| VqError::FileVersion { found: version.clone(), supported: FILE_VERSION })?;
        let saved: SavedConfig = serde_json::from_str(get("config")?).map_err(|e| corrupt("config", e))?;
        if v == 1 && saved.layer_specs.is_some() {
            return Err(VqError::FileCorrupt("a version 1 file with per-layer specs".into()));
        }
        let info = SaveInfo {
            model: meta.get("model").cloned(),
            user: meta.iter().filter_map(|(k, v)| Some((k.strip_prefix("user.")?.to_string(), v.clone()))).collect(),
        };
        check_fingerprint(&saved, &info, check)?;
        let want_crc = u32::from_str_radix(get("crc32")?, 16).map_err(|e| corrupt("crc32", e))?;
        let mut cfg = saved.config()?;

        // The tensor table must be exactly the plan, back to back in plan order (empty
        // tensors share an offset, so the order is the plan's, not the offsets'), with
        // shapes from the config; trained states follow in (layer, head, stream) order.
        let tensors = metadata.tensors();
        let mut states = Vec::new();
        for name in tensors.keys().filter(|n| n.ends_with(".state")) {
            let key = parse_state_name(name)
                .filter(|&(l, h, _)| l < cfg.n_layers && h < cfg.n_kv_heads)
                .ok_or_else(|| VqError::FileCorrupt(format!("unexpected tensor {name:?}")))?;
            states.push(key);
        }
        states.sort_by_key(|&(l, h, s)| (l, h, s == Stream::Values));
        let parts = plan(cfg.n_layers, states);
        if tensors.len() != parts.len() {
            return Err(VqError::FileCorrupt(format!("{} tensors, expected {}", tensors.len(), parts.len())));
        }
        let mut names = Vec::with_capacity(parts.len());
        let mut offset = 0;
        for part in &parts {
            let name = part.name();
            let ti = tensors.get(&name).ok_or_else(|| VqError::FileCorrupt(format!("tensor {name:?} missing")))?;
            if ti.data_offsets.0 != offset {
                return Err(VqError::FileCorrupt(format!("tensor {name:?} out of order")));
            }
            offset = ti.data_offsets.1;
            saved.check_shape(*part, ti)?;
            names.push(name);
        }

        // Payload: bounded reads into the final buffers, checksummed as they arrive.
        let mut crc = metadata_crc(&meta);
        let (h, d) = (cfg.n_kv_heads, cfg.head_dim);
        let mut contents: HashMap<(usize, usize, Stream), StreamParts> = HashMap::new();
        let mut states: HashMap<(usize, usize, Stream), Arc<[f32]>> = HashMap::new();
        for (part, name) in parts.iter().zip(&names) {
            let ti = tensors[name];
            match *part {
                Part::Pages(l, s) => {
                    let (np, pb) = (ti.shape[1], ti.shape[2]);
                    for hh in 0..h {
                        let mut pages: Vec<Page> = Vec::new();
                        for _ in 0..np {
                            let page = read_bounded(r, pb, name)?;
                            crc.update(&page);
                            pages.push(page.into());
                        }
                        let e = contents.entry((l, hh, s)).or_insert_with(StreamParts::empty);
                        e.pages = pages;
                        e.open_rows = saved.layers[l].stream(s).open_rows;
                    }
                }
                Part::Sink(l, s) | Part::Tail(l, s) => {
                    let per_head = ti.shape[1] * d;
                    for hh in 0..h {
                        let bytes = read_bounded(r, per_head * 2, name)?;
                        crc.update(&bytes);
                        let vals = bytes.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]])).collect();
                        let e = contents.entry((l, hh, s)).or_insert_with(StreamParts::empty);
                        match part {
                            Part::Sink(..) => e.sink = vals,
                            _ => e.tail = vals,
                        }
                    }
                }
                Part::State(l, hh, s) => {
                    let bytes = read_bounded(r, ti.shape[0] * 4, name)?;
                    crc.update(&bytes);
                    let vals: Vec<f32> =
                        bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
                    states.insert((l, hh, s), vals.into());
                }
            }
        }
        let payload_len = offset;
        let got_crc = crc.finalize();
        if got_crc != want_crc {
            return Err(VqError::FileChecksum { expected: want_crc, found: got_crc });
        }

        check_structure_cost(&cfg, &states, payload_len)?;
        let formats = PagedCache::build_formats(&cfg, |l, h, s| states.get(&(l, h, s)).cloned())?;
        // A state tensor must match what its format keeps (none for untrained formats).
        for (l, (kf, vf)) in formats.iter().enumerate() {
            for (s, fs) in [(Stream::Keys, kf), (Stream::Values, vf)] {
                for (hh, f) in fs.iter().enumerate() {
                    let saved_len = states.get(&(l, hh, s)).map_or(0, |x| x.len());
                    if f.export_state().len() != saved_len {
                        return Err(VqError::FileCorrupt(format!(
                            "layer {l} head {hh}: state does not fit its format"
                        )));
                    }
                }
            }
        }
        let mut row_mode = PagedCache::row_mode_of(&cfg, &formats);
        if row_mode && !saved.row_mode {
            // Formats that code rows now (vecinfer since 2026-12-06), saved in page mode: the
            // cache stays in page mode, as it was written.
            cfg.encode_rows = false;
            row_mode = false;
        }
        if row_mode != saved.row_mode {
            return Err(VqError::FileCorrupt("saved row mode does not match the formats".into()));
        }
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for (l, (kf, vf)) in formats.into_iter().enumerate() {
            let n_tokens = saved.layers[l].n_tokens;
            let mut wrap = |fs: Vec<Arc<dyn crate::Format>>, s: Stream| -> Result<Vec<StreamStore>> {
                fs.into_iter()
                    .enumerate()
                    .map(|(hh, f)| {
                        let parts = contents.remove(&(l, hh, s)).unwrap_or_else(StreamParts::empty);
                        let st = StreamStore::from_parts(f, cfg.recent, row_mode, cfg.sink, parts)?;
                        if st.n_tokens() != n_tokens {
                            return Err(VqError::FileCorrupt(format!(
                                "layer {l} head {hh}: {} tokens stored, config says {n_tokens}",
                                st.n_tokens()
                            )));
                        }
                        Ok(st)
                    })
                    .collect()
            };
            let keys = wrap(kf, Stream::Keys)?;
            let values = wrap(vf, Stream::Values)?;
            layers.push(LayerCache { keys, values, n_tokens });
        }
        Ok((PagedCache { cfg, layers, row_mode }, info))
    }
}

impl StreamParts {
    fn empty() -> Self {
        Self { pages: Vec::new(), open_rows: 0, tail: Vec::new(), sink: Vec::new() }
    }
}

impl SavedLayer {
    fn stream(&self, s: Stream) -> &SavedStream {
        match s {
            Stream::Keys => &self.k,
            Stream::Values => &self.v,
        }
    }
}

impl SavedConfig {
    fn config(&self) -> Result<CacheConfig> {
        let bad = |why: String| Err(VqError::FileCorrupt(why));
        if !(1..=MAX_LAYERS).contains(&self.n_layers)
            || !(1..=MAX_HEADS).contains(&self.n_kv_heads)
            || !(1..=MAX_HEAD_DIM).contains(&self.head_dim)
            || !(1..=MAX_PAGE_TOKENS).contains(&self.page_tokens)
        {
            return bad(format!(
                "dimensions out of range: {} layers, {} KV heads, d = {}, T = {}",
                self.n_layers, self.n_kv_heads, self.head_dim, self.page_tokens
            ));
        }
        if self.layers.len() != self.n_layers {
            return bad(format!("{} layer records for {} layers", self.layers.len(), self.n_layers));
        }
        let spec = |s: &str| FormatSpec::parse(s).map_err(|e| VqError::FileCorrupt(format!("format spec: {e}")));
        let mut cfg = CacheConfig::new(self.n_layers, self.n_kv_heads, self.head_dim, spec(&self.k)?, spec(&self.v)?);
        if let Some(ls) = &self.layer_specs {
            if ls.len() != self.n_layers {
                return bad(format!("{} per-layer specs for {} layers", ls.len(), self.n_layers));
            }
            cfg.layers = Some(ls.iter().map(|[k, v]| Ok(LayerSpec::new(spec(k)?, spec(v)?))).collect::<Result<_>>()?);
        }
        cfg.page_tokens = self.page_tokens;
        cfg.recent = self.recent;
        cfg.sink = self.sink;
        cfg.seed = self.seed;
        cfg.encode_rows = self.encode_rows;
        Ok(cfg)
    }

    /// A tensor's declared type and shape against what the config implies.
    fn check_shape(&self, part: Part, ti: &TensorInfo) -> Result<()> {
        let (h, d) = (self.n_kv_heads, self.head_dim);
        let (dtype, ok) = match part {
            Part::Pages(l, s) => {
                let st = self.layers[l].stream(s);
                (Dtype::U8, ti.shape.len() == 3 && ti.shape[..2] == [h, st.pages] && ti.shape[2] > 0)
            }
            Part::Sink(l, s) => (Dtype::F16, ti.shape == [h, self.layers[l].stream(s).sink, d]),
            Part::Tail(l, s) => (Dtype::F16, ti.shape == [h, self.layers[l].stream(s).tail, d]),
            Part::State(..) => (Dtype::F32, ti.shape.len() == 1),
        };
        if ti.dtype != dtype || !ok {
            return Err(VqError::FileCorrupt(format!(
                "tensor {} is {:?} {:?}, not what the config implies",
                part.name(),
                ti.dtype,
                ti.shape
            )));
        }
        Ok(())
    }
}

/// Refuse a header whose layers × heads × (format state + reserved fp16 tail and sinks)
/// exceed what its payload pays for (each layer's (head 0) formats are built to measure).
fn check_structure_cost(
    cfg: &CacheConfig,
    states: &HashMap<(usize, usize, Stream), Arc<[f32]>>,
    payload_len: usize,
) -> Result<()> {
    let reserved_tokens = cfg.recent.saturating_add(cfg.page_tokens).saturating_add(cfg.sink);
    let reserved = reserved_tokens.saturating_mul(cfg.head_dim).saturating_mul(4);
    // One probe per layer with its own specs; one for all layers otherwise.
    let (probes, repeat) = if cfg.layers.is_some() { (cfg.n_layers, 1) } else { (1, cfg.n_layers) };
    let mut total = 0usize;
    for l in 0..probes {
        let one = CacheConfig {
            n_layers: 1,
            n_kv_heads: 1,
            calibration: None,
            k: cfg.spec(l, Stream::Keys).clone(),
            v: cfg.spec(l, Stream::Values).clone(),
            layers: None,
            ..cfg.clone()
        };
        let probe = PagedCache::build_formats(&one, |_, _, s| states.get(&(l, 0, s)).cloned())?;
        let (kf, vf) = &probe[0];
        let per_head = (kf[0].state_bytes() + vf[0].state_bytes()).saturating_add(reserved);
        total = total.saturating_add(per_head.saturating_mul(cfg.n_kv_heads).saturating_mul(repeat));
    }
    let budget = STRUCTURE_ALLOWANCE.saturating_add(payload_len.saturating_mul(STRUCTURE_PER_PAYLOAD_BYTE));
    if total > budget {
        return Err(VqError::FileCorrupt(format!(
            "the header declares {total} B of structure for a {payload_len} B payload (limit {budget} B)"
        )));
    }
    Ok(())
}

fn check_fingerprint(saved: &SavedConfig, info: &SaveInfo, check: &LoadCheck) -> Result<()> {
    for (what, want, found) in [
        ("n_layers", check.n_layers, saved.n_layers),
        ("n_kv_heads", check.n_kv_heads, saved.n_kv_heads),
        ("head_dim", check.head_dim, saved.head_dim),
    ] {
        if let Some(w) = want.filter(|w| *w != found) {
            return Err(VqError::FileMismatch { what, expected: w.to_string(), found: found.to_string() });
        }
    }
    if let Some(want) = &check.model {
        if info.model.as_ref() != Some(want) {
            return Err(VqError::FileMismatch {
                what: "model",
                expected: want.clone(),
                found: info.model.clone().unwrap_or_else(|| "(none)".into()),
            });
        }
    }
    Ok(())
}

/// Checksum state after every metadata entry but `crc32` itself, in key order.
fn metadata_crc(meta: &HashMap<String, String>) -> crc32fast::Hasher {
    let mut crc = crc32fast::Hasher::new();
    let sorted: BTreeMap<&String, &String> = meta.iter().filter(|(k, _)| *k != "crc32").collect();
    for (k, v) in sorted {
        crc.update(k.as_bytes());
        crc.update(&[0]);
        crc.update(v.as_bytes());
        crc.update(&[0]);
    }
    crc
}

fn emit_f16(x: &[f16], sink: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
    for c in x.chunks(CHUNK / 2) {
        let bytes: Vec<u8> = c.iter().flat_map(|v| v.to_le_bytes()).collect();
        sink(&bytes)?;
    }
    Ok(())
}

fn corrupt(what: &str, e: impl std::fmt::Display) -> VqError {
    VqError::FileCorrupt(format!("{what}: {e}"))
}

fn read_full<R: Read>(r: &mut R, buf: &mut [u8], section: &str) -> Result<()> {
    r.read_exact(buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => VqError::FileTruncated { section: section.to_string() },
        _ => VqError::io("reading a cache file", &e),
    })
}

/// Exactly `n` bytes, allocated as they arrive (a lying size fails at the end of the input).
fn read_bounded<R: Read>(r: &mut R, n: usize, section: &str) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(n.min(CHUNK));
    while out.len() < n {
        let take = (n - out.len()).min(CHUNK);
        let at = out.len();
        out.resize(at + take, 0);
        read_full(r, &mut out[at..], section)?;
    }
    Ok(out)
}

/// Whether `r` starts as a cache file of this crate (framing and the `format` entry; the
/// payload is not read): lets a caller refuse to overwrite a file of another kind.
pub fn is_cache_file<R: Read>(r: &mut R) -> bool {
    let mut len = [0u8; 8];
    if read_full(r, &mut len, "header length").is_err() || u64::from_le_bytes(len) > MAX_HEADER_BYTES {
        return false;
    }
    let Ok(header) = read_bounded(r, u64::from_le_bytes(len) as usize, "header") else { return false };
    let meta = serde_json::from_slice::<Metadata>(&header).ok().and_then(|m| m.metadata().clone());
    meta.is_some_and(|m| m.get("format").map(String::as_str) == Some(FILE_KIND))
}

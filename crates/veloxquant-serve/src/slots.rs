//! Slots (llama-server's interface): a request with `id_slot` leaves its cache in that
//! slot, and a later request in the same slot continues from it; `POST /slots/{id}?action=
//! save|restore|erase` parks a slot's cache in a file under `--slot-dir` (the cache file
//! format of `PagedCache::save`, with the token ids in its metadata) and brings it back.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use axum::http::StatusCode;
use serde_json::{json, Value};
use veloxquant::cache::{LoadCheck, SaveInfo};
use veloxquant::PagedCache;

use crate::engine::{Engine, SeqId};
use crate::error::ApiError;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SlotAction {
    Save(String),
    Restore(String),
    Erase,
}

pub struct SlotEntry {
    pub seq: SeqId,
    /// The tokens in the cache, in order.
    pub tokens: Vec<u32>,
}

pub struct Slots {
    dir: Option<PathBuf>,
    fingerprint: Option<String>,
    map: HashMap<usize, SlotEntry>,
}

/// Longest slot file name accepted.
const MAX_NAME: usize = 128;

/// A plain file name: letters, digits, `.`, `_`, `-`; not starting with `.`. Anything
/// else (separators, `..`, absolute paths, NUL) is refused before the file system is touched.
pub fn check_file_name(name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && !name.starts_with('.')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid_param(
            "filename",
            format!("file name must be 1–{MAX_NAME} of [A-Za-z0-9._-], not starting with '.'"),
        ))
    }
}

impl Slots {
    pub fn new(dir: Option<PathBuf>, fingerprint: Option<String>) -> Self {
        Self { dir, fingerprint, map: HashMap::new() }
    }

    pub fn get(&self, id: usize) -> Option<&SlotEntry> {
        self.map.get(&id)
    }

    /// Puts a cache in a slot; returns the sequence it replaced (to free).
    pub fn park(&mut self, id: usize, e: SlotEntry) -> Option<SeqId> {
        self.map.insert(id, e).map(|old| old.seq)
    }

    pub fn seqs(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.map.values().map(|e| e.seq)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    fn path(&self, name: &str) -> Result<PathBuf, ApiError> {
        let dir = self.dir.as_ref().ok_or_else(|| ApiError::not_implemented("slot files need --slot-dir"))?;
        check_file_name(name)?;
        Ok(dir.join(name))
    }

    /// `room`: KV bytes still free under the budget (a restore must fit in it).
    pub fn act<E: Engine>(
        &mut self,
        engine: &mut E,
        id: usize,
        action: SlotAction,
        room: usize,
    ) -> Result<Value, ApiError> {
        match action {
            SlotAction::Erase => {
                let n = self.map.remove(&id).map(|e| {
                    engine.remove(e.seq);
                    e.tokens.len()
                });
                Ok(json!({"id_slot": id, "n_erased": n.unwrap_or(0)}))
            }
            SlotAction::Save(name) => {
                let path = self.path(&name)?;
                let e = self.map.get(&id).ok_or_else(|| ApiError::not_found(format!("slot {id} holds no cache")))?;
                let cache = engine.export(e.seq).map_err(|err| ApiError::internal(err.to_string()))?;
                let n_written = self.write(&path, &cache, &e.tokens)?;
                Ok(json!({"id_slot": id, "filename": name, "n_saved": e.tokens.len(), "n_written": n_written}))
            }
            SlotAction::Restore(name) => {
                let path = self.path(&name)?;
                let (cache, tokens, n_read) = self.read(&path, engine)?;
                let bytes = cache.resident_bytes();
                if bytes > room {
                    return Err(ApiError::busy(format!("restoring needs {bytes} B of KV cache; {room} B are free")));
                }
                let n = tokens.len();
                let seq = engine.import(cache).map_err(|e| ApiError::bad_request(format!("{name}: {e}")))?;
                if let Some(old) = self.park(id, SlotEntry { seq, tokens }) {
                    engine.remove(old);
                }
                Ok(json!({"id_slot": id, "filename": name, "n_restored": n, "n_read": n_read}))
            }
        }
    }

    fn write(&self, path: &Path, cache: &PagedCache, tokens: &[u32]) -> Result<u64, ApiError> {
        let io = |e: std::io::Error| ApiError::internal(format!("writing {}: {e}", path.display()));
        let tmp = path.with_extension("partial");
        let mut user = BTreeMap::new();
        user.insert("tokens".to_string(), serde_json::to_string(tokens).unwrap_or_default());
        let info = SaveInfo { model: self.fingerprint.clone(), user };
        let mut w = BufWriter::new(std::fs::File::create(&tmp).map_err(io)?);
        let n = cache.save(&mut w, &info).map_err(|e| ApiError::internal(e.to_string()))?;
        w.flush().map_err(io)?;
        drop(w);
        std::fs::rename(&tmp, path).map_err(io)?;
        Ok(n)
    }

    fn read<E: Engine>(&self, path: &Path, engine: &E) -> Result<(PagedCache, Vec<u32>, u64), ApiError> {
        let f = std::fs::File::open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => ApiError::not_found(format!("no slot file {}", path.display())),
            _ => ApiError::internal(format!("{}: {e}", path.display())),
        })?;
        let n_read = f.metadata().map(|m| m.len()).unwrap_or(0);
        let c = &engine.info().cache;
        let check = LoadCheck {
            n_layers: Some(c.n_layers),
            n_kv_heads: Some(c.n_kv_heads),
            head_dim: Some(c.head_dim),
            model: self.fingerprint.clone(),
        };
        let bad = |m: String| ApiError::with_status(StatusCode::BAD_REQUEST, m);
        let (cache, info) = PagedCache::load(&mut BufReader::new(f), &check).map_err(|e| bad(e.to_string()))?;
        let tokens: Vec<u32> = info
            .user
            .get("tokens")
            .and_then(|t| serde_json::from_str(t).ok())
            .ok_or_else(|| bad("the cache file carries no token ids (not a slot file)".into()))?;
        let held = cache.n_tokens(0).map_err(|e| bad(e.to_string()))?;
        if tokens.len() != held || tokens.len() > engine.info().n_ctx {
            return Err(bad(format!("slot file: {} token ids for {held} cached tokens", tokens.len())));
        }
        Ok((cache, tokens, n_read))
    }
}

#[cfg(test)]
mod tests {
    use super::check_file_name;

    #[test]
    fn traversal_and_odd_names_refused() {
        for ok in ["a.bin", "slot_1-x.cache", "A9"] {
            assert!(check_file_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "../x", "/etc/passwd", "a/b", ".hidden", "..", "a\\b", "a\0b", "é", &"x".repeat(129)] {
            assert!(check_file_name(bad).is_err(), "{bad:?}");
        }
    }
}

//! Any bytes given to the cache-file loader: a typed error or a cache, never a panic,
//! abort or an allocation of a declared size. A loaded cache must answer attention.
//!
//! An input whose first byte is odd is loaded after its checksum is recomputed
//! ("resealed"), so mutations also reach the checks behind the checksum (tensor contents,
//! stream invariants, format state), which a random flip almost never passes otherwise.
#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use veloxquant::cache::LoadCheck;
use veloxquant::PagedCache;

/// The file with `crc32` set to what the loader computes (sorted metadata, then payload).
fn reseal(file: &[u8]) -> Option<Vec<u8>> {
    let n = usize::try_from(u64::from_le_bytes(file.get(..8)?.try_into().ok()?)).ok()?;
    let header_end = n.checked_add(8).filter(|&e| e <= file.len())?;
    let mut header: serde_json::Value = serde_json::from_slice(&file[8..header_end]).ok()?;
    let meta = header.get_mut("__metadata__")?.as_object_mut()?;
    let mut crc = crc32fast::Hasher::new();
    let sorted: BTreeMap<&String, &serde_json::Value> = meta.iter().filter(|(k, _)| *k != "crc32").collect();
    for (k, v) in sorted {
        crc.update(k.as_bytes());
        crc.update(&[0]);
        crc.update(v.as_str()?.as_bytes());
        crc.update(&[0]);
    }
    crc.update(&file[header_end..]);
    meta.insert("crc32".into(), format!("{:08x}", crc.finalize()).into());
    let mut hb = serde_json::to_vec(&header).ok()?;
    hb.resize(hb.len().next_multiple_of(8), b' ');
    let mut out = (hb.len() as u64).to_le_bytes().to_vec();
    out.extend(hb);
    out.extend(&file[header_end..]);
    Some(out)
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, file)) = data.split_first() else { return };
    let resealed;
    let file = if mode & 1 == 1 {
        match reseal(file) {
            Some(f) => {
                resealed = f;
                &resealed[..]
            }
            None => file,
        }
    } else {
        file
    };
    if let Ok((cache, _)) = PagedCache::load(&mut std::io::Cursor::new(file), &LoadCheck::default()) {
        let cfg = cache.config();
        if cache.n_tokens(0).unwrap_or(0) > 0 {
            let q = vec![0.5f32; cfg.n_kv_heads * cfg.head_dim];
            let _ = veloxquant::attn::decode_attention(&cache, 0, &q, cfg.n_kv_heads);
        }
    }
});

//! Save a compressed cache to a file and load it back: attention is bit-identical.
//! `cargo run --release -p veloxquant --example save_load -- [DIR]` writes one small file
//! per configuration into DIR (default: the system temp dir); the fuzz seeds come from here.

use std::fs::File;
use std::io::{BufReader, BufWriter};

use veloxquant::cache::{LoadCheck, SaveInfo};
use veloxquant::rng::SplitMix64;
use veloxquant::{attn, CacheConfig, Calibration, FormatSpec, PagedCache, Stream};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args().nth(1).map(std::path::PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let mut rng = SplitMix64::new(1);
    // (K, V, window R, sinks S, tokens): row mode, page mode with sinks, a trained codebook.
    for (i, (k, v, recent, sink, n)) in [
        ("turboquant_mse:4:eden", "turboquant_mse:3", 4, 2, 45),
        ("kivi:2:g16", "q4_0:rot", 3, 1, 40),
        ("fp16", "vecinfer:4:g8", 0, 0, 9),
    ]
    .into_iter()
    .enumerate()
    {
        let mut cfg = CacheConfig::new(1, 1, 32, FormatSpec::parse(k)?, FormatSpec::parse(v)?);
        (cfg.recent, cfg.sink, cfg.page_tokens) = (recent, sink, 16);
        if v.starts_with("vecinfer") {
            let mut cal = Calibration::new();
            cal.insert_for_all(Stream::Values, rng.gaussian_vec(32 * 64));
            cfg.calibration = Some(cal.into());
        }
        let mut cache = PagedCache::new(cfg)?;
        cache.append(0, &rng.gaussian_vec(n * 32), &rng.gaussian_vec(n * 32), n)?;
        let path = dir.join(format!("cache-{i}.vqc"));
        let info = SaveInfo { model: Some("example".into()), user: [("note".into(), k.into())].into() };
        let bytes = cache.save(&mut BufWriter::new(File::create(&path)?), &info)?;
        let (back, _) = PagedCache::load(&mut BufReader::new(File::open(&path)?), &LoadCheck::default())?;
        let q = rng.gaussian_vec(2 * 32);
        assert_eq!(attn::decode_attention(&back, 0, &q, 2)?, attn::decode_attention(&cache, 0, &q, 2)?);
        println!("{}: {bytes} B, K {k} / V {v}, {n} tokens: reloaded, attention identical", path.display());
    }
    Ok(())
}

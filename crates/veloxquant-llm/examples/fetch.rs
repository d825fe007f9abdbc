//! cargo run --release --example fetch -- CACHE_DIR
fn main() -> veloxquant_llm::Result<()> {
    let dir = std::env::args().nth(1).expect("usage: fetch CACHE_DIR");
    let t = std::time::Instant::now();
    let path = veloxquant_llm::fetch_model(std::path::Path::new(&dir))?;
    println!("{} ({:.1}s)", path.display(), t.elapsed().as_secs_f64());
    Ok(())
}

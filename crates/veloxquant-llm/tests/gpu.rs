//! The model on the GPU against the CPU, on a small random-weight GGUF written by the test:
//! logits of prefill (in chunks) and of batched, graph-replayed decode steps agree with the
//! CPU's for the fp16 cache and the default compressed method; fork and trim continue as on
//! the CPU; the cache's device bytes match the CPU's resident bytes; bad input is a typed
//! error. Skips, saying so, without a GPU (or without the `cuda` feature: nothing to run).
#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use veloxquant::rng::SplitMix64;
use veloxquant::FormatSpec;
use veloxquant_cuda::GpuDevice;
use veloxquant_llm::eval::{argmax, kl_divergence, log_softmax_in_place};
use veloxquant_llm::gpu::{EngineConfig, GpuEngine, GpuMethod, GpuModel};
use veloxquant_llm::{CompressedStore, Fp16Store, KvStore, Llama, LlmError, WeightMode};

fn device() -> Option<Arc<GpuDevice>> {
    match GpuDevice::new(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("SKIPPED: no usable GPU ({e})");
            None
        }
    }
}

const LAYERS: usize = 3;
const HIDDEN: usize = 256;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const FFN: usize = 512;
const VOCAB: usize = 512;
const CTX: usize = 2048;

/// A Llama GGUF with random f16 weights (so the CPU and the GPU hold the same values).
fn tiny_gguf(dir: &Path, seed: u64) -> PathBuf {
    let path = dir.join(format!("tiny-{seed}.gguf"));
    let mut rng = SplitMix64::new(seed);
    let mut mat = |rows: usize, cols: usize, scale: f32, offset: f32| -> QTensor {
        let v: Vec<f32> = (0..rows * cols).map(|_| offset + scale * rng.next_gaussian() as f32).collect();
        let shape: Vec<usize> = if rows == 1 { vec![cols] } else { vec![rows, cols] };
        let t = Tensor::from_vec(v, shape, &Device::Cpu).unwrap();
        let dtype = if rows == 1 { GgmlDType::F32 } else { GgmlDType::F16 };
        QTensor::quantize(&t, dtype).unwrap()
    };
    let kvd = KV_HEADS * HIDDEN / HEADS;
    let mut tensors: Vec<(String, QTensor)> = vec![
        // Scales measured on the CPU to give a model that is neither one-hot (embeddings ≥ 1:
        // every KL ~1e-27) nor chaotic (q/k at 2/√h, embeddings 0.1: K and V perturbed by 1e-4
        // relative, as f16 matrix inputs do, move the compressed cache's logits by KL 3e-2):
        // here that perturbation costs KL ~2e-5 and no top-1 change.
        ("token_embd.weight".into(), mat(VOCAB, HIDDEN, 0.4, 0.0)),
        ("output_norm.weight".into(), mat(1, HIDDEN, 0.1, 1.0)),
    ];
    for i in 0..LAYERS {
        let s = |n: usize| 1.0 / (n as f32).sqrt();
        tensors.push((format!("blk.{i}.attn_norm.weight"), mat(1, HIDDEN, 0.1, 1.0)));
        tensors.push((format!("blk.{i}.attn_q.weight"), mat(HIDDEN, HIDDEN, 0.5 * s(HIDDEN), 0.0)));
        tensors.push((format!("blk.{i}.attn_k.weight"), mat(kvd, HIDDEN, 0.5 * s(HIDDEN), 0.0)));
        tensors.push((format!("blk.{i}.attn_v.weight"), mat(kvd, HIDDEN, s(HIDDEN), 0.0)));
        tensors.push((format!("blk.{i}.attn_output.weight"), mat(HIDDEN, HIDDEN, s(HIDDEN), 0.0)));
        tensors.push((format!("blk.{i}.ffn_norm.weight"), mat(1, HIDDEN, 0.1, 1.0)));
        tensors.push((format!("blk.{i}.ffn_gate.weight"), mat(FFN, HIDDEN, s(HIDDEN), 0.0)));
        tensors.push((format!("blk.{i}.ffn_up.weight"), mat(FFN, HIDDEN, s(HIDDEN), 0.0)));
        tensors.push((format!("blk.{i}.ffn_down.weight"), mat(HIDDEN, FFN, s(FFN), 0.0)));
    }
    let meta: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("llama.block_count", Value::U32(LAYERS as u32)),
        ("llama.embedding_length", Value::U32(HIDDEN as u32)),
        ("llama.feed_forward_length", Value::U32(FFN as u32)),
        ("llama.attention.head_count", Value::U32(HEADS as u32)),
        ("llama.attention.head_count_kv", Value::U32(KV_HEADS as u32)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.rope.freq_base", Value::F32(10_000.0)),
        ("llama.context_length", Value::U32(CTX as u32)),
    ];
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(&path).unwrap();
    gguf_file::write(&mut f, &meta_refs, &t_refs).unwrap();
    path
}

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("veloxquant-gpu-test-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn default_method() -> GpuMethod {
    GpuMethod {
        k: FormatSpec::parse("turboquant_mse:4:eden").unwrap(),
        v: FormatSpec::parse("turboquant_mse:3").unwrap(),
        recent: 8,
        sink: 4,
    }
}

fn cpu_store(model: &Llama, cfg: &EngineConfig) -> Box<dyn KvStore> {
    if cfg.method == GpuMethod::fp16() {
        Box::new(Fp16Store::for_config(&model.config, cfg.max_context))
    } else {
        Box::new(CompressedStore::new(cfg.cpu_cache(&model.config)).unwrap())
    }
}

/// Running agreement of GPU logits with CPU logits.
#[derive(Default)]
struct Agree {
    n: usize,
    same: usize,
    kl: f64,
    kl_max: f64,
}

impl Agree {
    fn add(&mut self, cpu: &[f32], gpu: &[f32]) {
        assert_eq!(cpu.len(), gpu.len());
        assert!(gpu.iter().all(|v| v.is_finite()), "non-finite GPU logits");
        for (a, b) in cpu.chunks(VOCAB).zip(gpu.chunks(VOCAB)) {
            let (mut la, mut lb) = (a.to_vec(), b.to_vec());
            log_softmax_in_place(&mut la);
            log_softmax_in_place(&mut lb);
            let kl = kl_divergence(&la, &lb);
            self.kl += kl;
            self.kl_max = self.kl_max.max(kl);
            self.same += usize::from(argmax(a) == argmax(b));
            self.n += 1;
        }
    }
    fn check(&self, what: &str) {
        let top1 = self.same as f64 / self.n as f64;
        let kl = self.kl / self.n as f64;
        eprintln!(
            "{what}: {} positions, top-1 equal {:.2} %, mean KL {kl:.2e}, max {:.2e}",
            self.n,
            100.0 * top1,
            self.kl_max
        );
        assert!(top1 >= 0.99, "{what}: top-1 agreement {top1}");
        assert!(kl <= 1e-3, "{what}: mean KL {kl}");
    }
}

#[test]
fn gpu_logits_match_cpu_prefill_and_batched_decode() {
    let Some(dev) = device() else { return };
    let dir = tmp_dir("logits");
    let path = tiny_gguf(&dir, 1);
    let cpu_model = Llama::load(&path, WeightMode::DequantF32).unwrap();
    let gpu_model = Arc::new(GpuModel::load(&dev, &path).unwrap());
    let mut rng = SplitMix64::new(3);
    let lens = [150usize, 77, 9];
    let prompts: Vec<Vec<u32>> =
        lens.iter().map(|&n| (0..n).map(|_| (rng.next_u64() % VOCAB as u64) as u32).collect()).collect();
    let steps = 40;
    let forced: Vec<Vec<u32>> =
        lens.iter().map(|_| (0..steps).map(|_| (rng.next_u64() % VOCAB as u64) as u32).collect()).collect();
    let qjl = GpuMethod {
        k: FormatSpec::parse("qjl").unwrap(),
        v: FormatSpec::parse("turboquant_mse:4").unwrap(),
        recent: 16,
        sink: 0,
    };
    let prod = GpuMethod {
        k: FormatSpec::parse("turboquant_prod:4").unwrap(),
        v: FormatSpec::parse("turboquant_mse:3").unwrap(),
        recent: 8,
        sink: 4,
    };
    let rvq = GpuMethod {
        k: FormatSpec::parse("turboquant_rvq:3:3").unwrap(),
        v: FormatSpec::parse("turboquant_mse:4").unwrap(),
        recent: 8,
        sink: 4,
    };
    let rabitq = GpuMethod {
        k: FormatSpec::parse("rabitq").unwrap(),
        v: FormatSpec::parse("turboquant_mse:4").unwrap(),
        recent: 16,
        sink: 0,
    };
    // kivi: whole pages leave the window (page mode).
    let kivi = GpuMethod {
        k: FormatSpec::parse("kivi:4").unwrap(),
        v: FormatSpec::parse("kivi:2:g16").unwrap(),
        recent: 32,
        sink: 4,
    };
    for method in [GpuMethod::fp16(), default_method(), qjl, prod, rvq, rabitq, kivi] {
        let mut cfg = EngineConfig::new(method.clone(), 4, 1024);
        cfg.prefill_chunk = 64; // several chunks per prompt: each attends as decode would
        cfg.prefill_rows = 128;
        let mut engine = GpuEngine::new(gpu_model.clone(), cfg.clone()).unwrap();
        let slots: Vec<usize> = lens.iter().map(|_| engine.add_sequence().unwrap()).collect();
        let items: Vec<(usize, &[u32], usize)> = slots.iter().zip(&prompts).map(|(&s, p)| (s, &p[..], 0)).collect();
        let gpu_prefill = engine.prefill(&items).unwrap();
        let mut agree_prefill = Agree::default();
        let mut agree_decode = Agree::default();
        let mut cpu_stores: Vec<Box<dyn KvStore>> = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let mut store = cpu_store(&cpu_model, &cfg);
            let want = cpu_model.forward(p, store.as_mut(), 0).unwrap();
            agree_prefill.add(&want, &gpu_prefill[i]);
            cpu_stores.push(store);
        }
        for t in 0..steps {
            let toks: Vec<(usize, u32)> = slots.iter().zip(&forced).map(|(&s, f)| (s, f[t])).collect();
            let out = engine.step(&toks, true).unwrap();
            let lg = out.logits.unwrap();
            for (i, store) in cpu_stores.iter_mut().enumerate() {
                let want = cpu_model.forward(&[forced[i][t]], store.as_mut(), 0).unwrap();
                let got = &lg[i * VOCAB..(i + 1) * VOCAB];
                assert_eq!(out.ids[i] as usize, argmax(got), "greedy id is the argmax of the logits");
                agree_decode.add(&want, got);
            }
        }
        let name = format!("{}/{}@{}+{}", method.k, method.v, method.recent, method.sink);
        agree_prefill.check(&format!("prefill {name}"));
        agree_decode.check(&format!("batched decode {name}"));
        // Device bytes of the compressed cache against the CPU's resident bytes, same tokens.
        for (i, &s) in slots.iter().enumerate() {
            let g = engine.cache.slot_bytes(s).unwrap();
            let c = cpu_stores[i].resident_bytes();
            eprintln!("{}: sequence {i}: GPU {g} B, CPU resident {c} B", method.k);
            // The same codes, window and state; the bookkeeping differs (the CPU pays a
            // reference-counted pointer per page and stream, 32 B and its Vec's slack; the GPU
            // a 4-byte table entry per page and head). The fp16 store reserves its context.
            // Page mode (kivi) reserves a window of R + T slots where the CPU holds R to R + T − 1
            // tokens: up to a page of exact rows more.
            let cc = &engine.cache.cfg;
            let slack = if engine.cache.row_mode {
                0
            } else {
                cc.n_layers * 2 * cc.n_kv_heads * cc.page_tokens * cc.head_dim * 2
            };
            if method != GpuMethod::fp16() {
                assert!((g as f64 - c as f64).abs() <= 0.03 * c as f64 + slack as f64, "sequence {i}: {g} vs {c}");
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn gpu_fork_and_trim_continue_like_cpu() {
    let Some(dev) = device() else { return };
    let dir = tmp_dir("fork");
    let path = tiny_gguf(&dir, 2);
    let cpu_model = Llama::load(&path, WeightMode::DequantF32).unwrap();
    let gpu_model = Arc::new(GpuModel::load(&dev, &path).unwrap());
    let cfg = EngineConfig::new(default_method(), 4, 512);
    let mut engine = GpuEngine::new(gpu_model, cfg.clone()).unwrap();
    let mut rng = SplitMix64::new(5);
    let mut tok = || (rng.next_u64() % VOCAB as u64) as u32;
    let prompt: Vec<u32> = (0..120).map(|_| tok()).collect();
    let a = engine.add_sequence().unwrap();
    engine.prefill(&[(a, &prompt, prompt.len())]).unwrap();
    let mut cpu_a = CompressedStore::new(cfg.cpu_cache(&cpu_model.config)).unwrap();
    cpu_model.forward(&prompt, &mut cpu_a, prompt.len()).unwrap();
    let b = engine.fork(a).unwrap();
    let mut cpu_b = cpu_a.fork();
    engine.trim(a, 13).unwrap();
    cpu_a.trim(13).unwrap();
    let mut agree = Agree::default();
    for _ in 0..20 {
        let (ta, tb) = (tok(), tok());
        let out = engine.step(&[(a, ta), (b, tb)], true).unwrap();
        let lg = out.logits.unwrap();
        agree.add(&cpu_model.forward(&[ta], &mut cpu_a, 0).unwrap(), &lg[..VOCAB]);
        agree.add(&cpu_model.forward(&[tb], &mut cpu_b, 0).unwrap(), &lg[VOCAB..]);
    }
    agree.check("fork + trim, then batched decode");
    assert_eq!(engine.n_tokens(a).unwrap(), 120 - 13 + 20);
    std::fs::remove_dir_all(&dir).ok();
}

/// A sequence moves between devices through the cache file: prefilled on the GPU, exported,
/// saved, loaded, imported into another engine, it continues exactly as the original does
/// (bit-identical logits); loaded on the CPU, it continues as the CPU would.
#[test]
fn gpu_sequence_moves_through_the_cache_file() {
    use veloxquant::cache::{LoadCheck, SaveInfo};
    use veloxquant::PagedCache;
    let Some(dev) = device() else { return };
    let dir = tmp_dir("move");
    let path = tiny_gguf(&dir, 4);
    let cpu_model = Llama::load(&path, WeightMode::DequantF32).unwrap();
    let gpu_model = Arc::new(GpuModel::load(&dev, &path).unwrap());
    let cfg = EngineConfig::new(default_method(), 2, 512);
    let mut a = GpuEngine::new(gpu_model.clone(), cfg.clone()).unwrap();
    let mut rng = SplitMix64::new(8);
    let mut tok = || (rng.next_u64() % VOCAB as u64) as u32;
    let prompt: Vec<u32> = (0..101).map(|_| tok()).collect();
    let s = a.add_sequence().unwrap();
    a.prefill(&[(s, &prompt, prompt.len())]).unwrap();
    let mut file = Vec::new();
    a.export(s).unwrap().save(&mut file, &SaveInfo::default()).unwrap();
    let (loaded, _) = PagedCache::load(&mut file.as_slice(), &LoadCheck::default()).unwrap();
    let mut b = GpuEngine::new(gpu_model, cfg).unwrap();
    let sb = b.import(&loaded).unwrap();
    assert_eq!(b.n_tokens(sb).unwrap(), prompt.len());
    let mut cpu = CompressedStore::from_cache(loaded);
    let mut agree = Agree::default();
    for _ in 0..12 {
        let t = tok();
        let la = a.step(&[(s, t)], true).unwrap().logits.unwrap();
        let lb = b.step(&[(sb, t)], true).unwrap().logits.unwrap();
        assert_eq!(
            la.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            lb.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "the imported sequence continues bit-identically"
        );
        agree.add(&cpu_model.forward(&[t], &mut cpu, 0).unwrap(), &lb);
    }
    agree.check("GPU sequence continued on the CPU from its cache file");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn gpu_engine_rejects_bad_input_with_typed_errors() {
    let Some(dev) = device() else { return };
    let dir = tmp_dir("bad");
    let path = tiny_gguf(&dir, 3);
    let model = Arc::new(GpuModel::load(&dev, &path).unwrap());
    // Planned before allocating: a cache far beyond the device's memory.
    let huge = EngineConfig::new(GpuMethod::fp16(), 1 << 16, CTX);
    match GpuEngine::new(model.clone(), huge) {
        Err(LlmError::Gpu(veloxquant_cuda::CudaError::OutOfDeviceMemory { need, free, .. })) => {
            eprintln!("huge cache refused: needs {need} B, {free} B free")
        }
        other => panic!("expected OutOfDeviceMemory, got {:?}", other.err()),
    }
    let too_long = EngineConfig::new(GpuMethod::fp16(), 1, CTX + 1);
    assert!(matches!(GpuEngine::new(model.clone(), too_long), Err(LlmError::InvalidArgument(_))));
    let mut e = GpuEngine::new(model, EngineConfig::new(default_method(), 2, 64)).unwrap();
    let s = e.add_sequence().unwrap();
    assert!(matches!(e.prefill(&[(s, &[VOCAB as u32], 1)]), Err(LlmError::TokenOutOfRange { .. })));
    assert!(matches!(e.prefill(&[(s, &[1; 65], 65)]), Err(LlmError::ContextOverflow { .. })));
    assert!(matches!(e.step(&[(s, 1), (s, 2)], false), Err(LlmError::InvalidArgument(_))));
    assert!(matches!(e.step(&[], false), Err(LlmError::InvalidArgument(_))));
    assert!(e.step(&[(7, 1)], false).is_err(), "an unknown slot");
    let _ = e.add_sequence().unwrap();
    assert!(matches!(e.add_sequence(), Err(LlmError::Gpu(veloxquant_cuda::CudaError::OutOfCapacity { .. }))));
    // The engine still works after the refusals (no sticky CUDA error).
    e.prefill(&[(s, &[1, 2, 3], 2)]).unwrap();
    let out = e.step(&[(s, 4)], false).unwrap();
    assert_eq!(out.ids.len(), 1);
    std::fs::remove_dir_all(&dir).ok();
}

/// Prefill attention alone (one layer, no model) against the CPU store's teacher-forced
/// attention, chunk by chunk: what each query sees through the codes, the exact band and
/// the sinks must agree.
/// One prefill shape through `kernel`: chunks of `chunks` tokens appended to a CPU store and
/// the device cache alike; the worst relative error of the device's attention output.
#[allow(clippy::too_many_arguments)]
fn prefill_worst(
    dev: &Arc<GpuDevice>,
    (hkv, g, d): (usize, usize, usize),
    (k, v, recent, sink): (&str, &str, usize, usize),
    max_chunk: usize,
    chunks: &[usize],
    kernel: veloxquant_cuda::PrefillKernel,
    seed: u64,
) -> f64 {
    use half::f16;
    use veloxquant::CacheConfig;
    use veloxquant_cuda::cache::AppendSrc;
    use veloxquant_cuda::{Blas, GpuCacheConfig, GpuKvCache, PrefillAttn};
    let hq = hkv * g;
    let max_ctx: usize = chunks.iter().sum::<usize>().next_multiple_of(64);
    let mut cfg = CacheConfig::new(1, hkv, d, FormatSpec::parse(k).unwrap(), FormatSpec::parse(v).unwrap());
    cfg.recent = recent;
    cfg.sink = sink;
    let mut cache = GpuKvCache::new(dev, GpuCacheConfig::from_cpu(&cfg, 1, max_ctx, max_ctx)).unwrap();
    let mut pre = PrefillAttn::with_kernel(&cache, hq, max_chunk, max_ctx, kernel).unwrap();
    let blas = Blas::new(dev).unwrap();
    let slot = cache.add_seq().unwrap();
    let mut cpu = CompressedStore::new(cfg.clone()).unwrap();
    let mut rng = SplitMix64::new(seed);
    let st = dev.stream.clone();
    let mut worst = 0f64;
    for &n in chunks {
        let round = |x: Vec<f32>| x.into_iter().map(|a| f16::from_f32(a).to_f32()).collect::<Vec<f32>>();
        let q = round(rng.gaussian_vec(n * hq * d)); // [n][hq][d]
        let kk = rng.gaussian_vec(n * hkv * d); // [n][hkv][d]
        let vv = rng.gaussian_vec(n * hkv * d);
        let heads = |x: &[f32], nh: usize| -> Vec<f32> {
            let mut o = vec![0f32; x.len()];
            for t in 0..n {
                for h in 0..nh {
                    o[(h * n + t) * d..(h * n + t + 1) * d].copy_from_slice(&x[(t * nh + h) * d..(t * nh + h + 1) * d]);
                }
            }
            o
        };
        cpu.append(0, &heads(&kk, hkv), &heads(&vv, hkv), n).unwrap();
        let want = cpu.attend(0, &heads(&q, hq), n).unwrap(); // [n][hq·d]
        let row = cache.plan_append(slot, n, 0).unwrap();
        cache.sync_meta().unwrap();
        let rows = st.clone_htod(&[row]).unwrap();
        let mut q16 = vec![0u16; n * hq * d]; // [kv][n][g][d]
        for t in 0..n {
            for h in 0..hq {
                for e in 0..d {
                    q16[(((h / g) * n + t) * g + h % g) * d + e] = f16::from_f32(q[(t * hq + h) * d + e]).to_bits();
                }
            }
        }
        let (q16d, kd, vd) = (st.clone_htod(&q16).unwrap(), st.clone_htod(&kk).unwrap(), st.clone_htod(&vv).unwrap());
        let mut out = st.alloc_zeros::<u16>(n * hq * d).unwrap();
        let ks = AppendSrc { data: kd.slice(..), stride: hkv * d };
        let vs = AppendSrc { data: vd.slice(..), stride: hkv * d };
        pre.run(
            &blas,
            &mut cache,
            0,
            &row,
            &rows.slice(..),
            (&ks, &vs),
            &q16d.slice(..),
            n,
            &mut out.slice_mut(..),
            &st,
        )
        .unwrap();
        let got: Vec<f32> = st.clone_dtoh(&out).unwrap().into_iter().map(|b| f16::from_bits(b).to_f32()).collect();
        let scale = want.iter().fold(0f64, |m, x| m.max(x.abs() as f64));
        let err = got.iter().zip(&want).fold(0f64, |m, (a, b)| m.max((*a as f64 - *b as f64).abs())) / scale;
        if err > 5e-3 {
            for t in 0..n {
                let e: f64 =
                    (0..hq * d).map(|i| (got[t * hq * d + i] - want[t * hq * d + i]).abs() as f64).fold(0.0, f64::max);
                if e / scale > 5e-3 {
                    eprintln!(
                        "  {k}/{v} {kernel:?} chunk of {n}: first bad query row {t} (position {}): {:.2e}",
                        row.pos0 as usize + t,
                        e / scale
                    );
                    break;
                }
            }
        }
        worst = worst.max(err);
    }
    worst
}

/// Prefill attention on the device equals the CPU store's (codes older than each query's
/// window, exact values newer), through both kernels: the GEMMs and the fused flash kernel
/// (d = 64 and 128, G ∈ {2, 3, 4}, chunks spanning several of its 64-row blocks and key tiles,
/// row and page mode, sinks).
#[test]
fn gpu_prefill_attention_matches_cpu_store() {
    use veloxquant_cuda::PrefillKernel;
    let Some(dev) = device() else { return };
    let methods = [
        ("fp16", "fp16", 0, 0),
        ("turboquant_mse:4:eden", "turboquant_mse:3", 8, 4),
        ("q8_0", "q4_0:rot", 5, 0),
        ("qjl:orth", "turboquant_mse:2", 8, 0),
        ("turboquant_prod:3", "turboquant_mse:3", 4, 4),
        ("rabitq", "turboquant_mse:2", 8, 0),
        ("turboquant_rvq:2:2", "turboquant_mse:4", 4, 4),
        ("turboquant_rvq:4:2", "q8_0", 0, 0),
        ("kivi:2", "kivi:2", 8, 4),
        ("kivi:4:g16", "turboquant_mse:3", 0, 0),
    ];
    for m in methods {
        for kernel in [PrefillKernel::Gemm, PrefillKernel::Flash] {
            if kernel == PrefillKernel::Flash && m.0 == "rabitq" {
                continue; // the GEMM path's own (4-bit query)
            }
            let worst = prefill_worst(&dev, (2, 2, 64), m, 64, &[37, 64, 20, 3], kernel, 9);
            eprintln!(
                "prefill attention {}/{}@{}+{} {kernel:?} vs the CPU store: worst rel err {worst:.2e}",
                m.0, m.1, m.2, m.3
            );
            assert!(worst <= 5e-3, "{}/{} {kernel:?}: {worst:.2e}", m.0, m.1);
        }
    }
    // Longer chunks, other shapes: several row blocks and key tiles per chunk.
    for (shape, m) in [
        ((2, 4, 128), ("turboquant_mse:4:eden", "turboquant_mse:3", 8, 4)),
        ((3, 3, 64), ("turboquant_mse:4:eden", "turboquant_mse:3", 8, 4)),
        ((3, 3, 64), ("fp16", "fp16", 0, 0)),
        ((2, 4, 128), ("kivi:2", "kivi:4", 32, 4)),
        ((1, 3, 64), ("q4_0", "q8_0", 0, 8)),
    ] {
        for kernel in [PrefillKernel::Gemm, PrefillKernel::Flash] {
            let worst = prefill_worst(&dev, shape, m, 256, &[150, 1, 256, 70, 200], kernel, 11);
            eprintln!(
                "prefill attention {shape:?} {}/{}@{}+{} {kernel:?}: worst rel err {worst:.2e}",
                m.0, m.1, m.2, m.3
            );
            assert!(worst <= 5e-3, "{shape:?} {}/{} {kernel:?}: {worst:.2e}", m.0, m.1);
        }
    }
    assert_eq!(
        PrefillKernel::best(&veloxquant_cuda::GpuCacheConfig::from_cpu(
            &veloxquant::CacheConfig::new(
                1,
                2,
                64,
                FormatSpec::parse("rabitq").unwrap(),
                FormatSpec::parse("fp16").unwrap()
            ),
            1,
            64,
            64
        )),
        PrefillKernel::Gemm
    );
}

/// The flash prefill on a few small shapes, sized for compute-sanitizer (`gpu sanitizer_`).
#[test]
fn sanitizer_prefill_flash_matches_cpu_store() {
    use veloxquant_cuda::PrefillKernel;
    let Some(dev) = device() else { return };
    for (shape, m, chunks) in [
        ((2, 2, 64), ("turboquant_mse:4:eden", "turboquant_mse:3", 8, 4), &[37usize, 64, 20][..]),
        ((1, 3, 128), ("fp16", "fp16", 0, 0), &[100, 30][..]),
    ] {
        let worst = prefill_worst(&dev, shape, m, 128, chunks, PrefillKernel::Flash, 5);
        eprintln!("sanitizer prefill {shape:?} {}/{}: {worst:.2e}", m.0, m.1);
        assert!(worst <= 5e-3, "{shape:?} {}/{}: {worst:.2e}", m.0, m.1);
    }
}

/// The device sampler (`sample_rows`) chooses what `sample_token` chooses on the same
/// logits — over a vocabulary wider than its block, with top-k, top-p, ties and non-finite
/// logits — and the engine's sampled step uses it on its own logits, row by row.
#[test]
fn gpu_sampling_matches_the_cpu_reference() {
    use veloxquant_llm::sample::{sample_token, SampleParams};
    let Some(dev) = device() else { return };
    let st = dev.stream.clone();
    let ops = veloxquant_cuda::ops::ModelOps::new(&dev).unwrap();
    let nv = 50_000;
    let sets =
        [(0.8f32, 1.0f32, 0usize), (1.0, 0.9, 0), (0.7, 1.0, 40), (1.3, 0.5, 100), (0.6, 0.95, 7), (0.0, 1.0, 0)];
    let mut rng = SplitMix64::new(21);
    let mut logits = Vec::new();
    let mut words = Vec::new();
    let mut want = Vec::new();
    for (r, &(t, tp, k)) in sets.iter().cycle().take(4 * sets.len()).enumerate() {
        let scale = [0.5f32, 2.0, 6.0, 1.0][r % 4];
        let mut row: Vec<f32> = (0..nv).map(|_| scale * rng.next_gaussian() as f32).collect();
        if r % 5 == 1 {
            row[17] = f32::NAN;
            row[99] = f32::NEG_INFINITY;
            let top = row.iter().copied().fold(f32::MIN, f32::max);
            row[4242] = top; // a tie at the top
        }
        let p = SampleParams { temperature: t, top_p: tp, top_k: k, seed: 1000 + r as u64 };
        let draw = r as u64 * 3;
        want.push(if p.is_greedy() { argmax(&row) as i32 } else { sample_token(&row, &p, draw) as i32 });
        words.extend(veloxquant_cuda::ops::sample_params(t, tp, k as u64, p.seed, draw));
        logits.extend(row);
    }
    let rows = want.len();
    let mut d_logits = st.alloc_zeros::<f32>(logits.len()).unwrap();
    st.memcpy_htod(&logits, &mut d_logits).unwrap();
    let mut d_words = st.alloc_zeros::<u64>(words.len()).unwrap();
    st.memcpy_htod(&words, &mut d_words).unwrap();
    let mut d_ids = st.alloc_zeros::<i32>(rows).unwrap();
    ops.sample(&st, &d_logits.slice(..), rows, nv, &d_words.slice(..), &mut d_ids.slice_mut(..)).unwrap();
    let mut got = vec![0i32; rows];
    st.memcpy_dtoh(&d_ids, &mut got).unwrap();
    assert_eq!(got, want, "device vs CPU sampled tokens, row by row");
    // Too few words for the rows: a typed error, no launch.
    assert!(ops.sample(&st, &d_logits.slice(..), rows, nv, &d_words.slice(..8), &mut d_ids.slice_mut(..)).is_err());

    // The engine: rows 0 and 2 sample (their draws advancing), row 1 stays greedy.
    let dir = tmp_dir("sample");
    let path = tiny_gguf(&dir, 4);
    let model = Arc::new(GpuModel::load(&dev, &path).unwrap());
    let mut engine = GpuEngine::new(model, EngineConfig::new(default_method(), 4, 512)).unwrap();
    let slots: Vec<usize> = (0..3).map(|_| engine.add_sequence().unwrap()).collect();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 % VOCAB) as u32).collect();
    let items: Vec<(usize, &[u32], usize)> = slots.iter().map(|&s| (s, &prompt[..], prompt.len())).collect();
    engine.prefill(&items).unwrap();
    // The tiny random model's logits are peaked (at 1.5, top-p 0.9 kept one token in every
    // step on the H200): a high temperature flattens them, so the draws must show.
    let params = SampleParams { temperature: 8.0, top_p: 0.9, top_k: 0, seed: 5 };
    let mut next = vec![1u32; 3];
    let mut varied = std::collections::HashSet::new();
    for draw in 0..12u64 {
        let toks: Vec<(usize, u32)> = slots.iter().zip(&next).map(|(&s, &t)| (s, t)).collect();
        let sampling = [Some((params, draw)), None, Some((SampleParams { seed: 6, ..params }, draw))];
        let out = engine.step_sampled(&toks, &sampling, true).unwrap();
        let lg = out.logits.unwrap();
        let row = |i: usize| &lg[i * VOCAB..(i + 1) * VOCAB];
        assert_eq!(out.ids[0], sample_token(row(0), &params, draw), "step {draw}: row 0");
        assert_eq!(out.ids[1] as usize, argmax(row(1)), "step {draw}: row 1 greedy");
        assert_eq!(out.ids[2], sample_token(row(2), &SampleParams { seed: 6, ..params }, draw), "step {draw}: row 2");
        varied.insert(out.ids[0]);
        next = out.ids.clone();
    }
    assert!(varied.len() > 1, "sampling at temperature 8 never varied in 12 steps");
    assert!(engine.step_sampled(&[(slots[0], 1)], &[None, None], false).is_err(), "sampling entries ≠ rows");
    std::fs::remove_dir_all(&dir).ok();
}

/// A launched prefill (`prefill_launch`, a decode step queued behind it, then both collected:
/// the server's step) chooses each prompt's next token as the host would from `prefill`'s
/// logits of the same forward on a twin engine; the step's logits are the twin's; chunks
/// past the engine's sizes are typed errors.
#[test]
fn gpu_prefill_launch_chooses_what_the_host_would() {
    use veloxquant_llm::sample::{sample_token, NextToken, SampleParams};
    let Some(dev) = device() else { return };
    let dir = tmp_dir("prefill-launch");
    let path = tiny_gguf(&dir, 9);
    let model = Arc::new(GpuModel::load(&dev, &path).unwrap());
    let mut cfg = EngineConfig::new(default_method(), 5, 512);
    cfg.prefill_chunk = 96;
    cfg.prefill_rows = 256;
    let (mut a, mut b) = (GpuEngine::new(model.clone(), cfg.clone()).unwrap(), GpuEngine::new(model, cfg).unwrap());
    let mut rng = SplitMix64::new(31);
    let prompts: Vec<Vec<u32>> = [70usize, 96, 33, 50]
        .iter()
        .map(|&n| (0..n).map(|_| (rng.next_u64() % VOCAB as u64) as u32).collect())
        .collect();
    // Slot 0 decodes while slots 1-3 are prefilled.
    let slots: Vec<usize> = (0..4).map(|_| a.add_sequence().unwrap()).collect();
    assert_eq!(slots, (0..4).map(|_| b.add_sequence().unwrap()).collect::<Vec<_>>());
    a.prefill(&[(slots[0], &prompts[0][..], prompts[0].len())]).unwrap();
    b.prefill(&[(slots[0], &prompts[0][..], prompts[0].len())]).unwrap();
    // The tiny model's logits are peaked: temperature 8 makes the draw matter.
    let hot = SampleParams { temperature: 8.0, top_p: 0.95, top_k: 0, seed: 77 };
    let wants = [NextToken::Greedy, NextToken::Sample(hot, 5), NextToken::Nothing];
    let items: Vec<(usize, &[u32], NextToken)> = (1..4).map(|i| (slots[i], &prompts[i][..], wants[i - 1])).collect();
    let pending = a.prefill_launch(&items).unwrap();
    let step = a.step_launch(&[(slots[0], 7)], &[], true).unwrap();
    let step = a.step_collect(step).unwrap();
    let got = a.prefill_collect(pending).unwrap();

    let twin_items: Vec<(usize, &[u32], usize)> =
        (1..4).map(|i| (slots[i], &prompts[i][..], prompts[i].len() - 1)).collect();
    let lg = b.prefill(&twin_items).unwrap();
    let twin_step = b.step(&[(slots[0], 7)], true).unwrap();
    assert_eq!(got[0], Some(argmax(&lg[0]) as u32), "greedy item");
    assert_eq!(got[1], Some(sample_token(&lg[1], &hot, 5)), "sampled item");
    assert_eq!(got[2], None, "an item that wants no token");
    assert_eq!(step.ids, twin_step.ids, "the decode step queued behind the prefill");
    assert_eq!(step.logits, twin_step.logits);
    // Both engines' caches continue alike.
    let (na, nb) = (a.step(&[(slots[2], 3)], true).unwrap(), b.step(&[(slots[2], 3)], true).unwrap());
    assert_eq!(na.logits, nb.logits, "after the launched prefill");

    let e = a.add_sequence().unwrap();
    let long = vec![1u32; 97];
    assert!(matches!(a.prefill_launch(&[(e, &long[..], NextToken::Greedy)]), Err(LlmError::InvalidArgument(_))));
    assert!(matches!(a.prefill_launch(&[]), Err(LlmError::InvalidArgument(_))));
    let twice = [(e, &long[..8], NextToken::Nothing), (e, &long[..8], NextToken::Nothing)];
    assert!(matches!(a.prefill_launch(&twice), Err(LlmError::InvalidArgument(_))));
    std::fs::remove_dir_all(&dir).ok();
}

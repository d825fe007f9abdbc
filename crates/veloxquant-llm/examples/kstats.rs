// scratch analysis (not committed)
use veloxquant::codebook::ScaledCodebook;
use veloxquant::rotate::Rotation;
use veloxquant_llm::*;
struct Rec {
    inner: Fp16Store,
    kv: Vec<(usize, Vec<f32>, Vec<f32>, usize)>,
    q: Vec<(usize, Vec<f32>, usize)>,
}
impl KvStore for Rec {
    fn append(&mut self, l: usize, k: &[f32], v: &[f32], n: usize) -> Result<()> {
        self.kv.push((l, k.to_vec(), v.to_vec(), n));
        self.inner.append(l, k, v, n)
    }
    fn attend(&mut self, l: usize, q: &[f32], n: usize) -> Result<Vec<f32>> {
        self.q.push((l, q.to_vec(), n));
        self.inner.attend(l, q, n)
    }
    fn len(&self, l: usize) -> usize {
        self.inner.len(l)
    }
    fn resident_bytes(&self) -> usize {
        0
    }
}
// quantize rows (already rotated, any permutation); bits per channel
fn quant(v: &[f32], bits: &[u32], cbs: &[ScaledCodebook; 5], d_full: usize) -> Vec<f32> {
    let nr = v.iter().map(|a| (a * a) as f64).sum::<f64>().sqrt() as f32;
    if nr == 0.0 {
        return v.to_vec();
    }
    let s = (v.len() as f32 / d_full as f32).sqrt(); // codebook for dim v.len()
    let _ = s;
    v.iter()
        .zip(bits)
        .map(|(a, &b)| {
            let cb = &cbs[b as usize];
            let y = a / nr;
            cb.centroids[cb.quantize(y) as usize] * nr
        })
        .collect()
}
fn main() {
    let path = std::path::PathBuf::from(std::env::var("HOME").unwrap())
        .join(".cache/veloxquant/SmolLM2-135M-Instruct.Q4_1.gguf");
    let tok = Tokenizer::from_gguf_path(&path).unwrap();
    let model = Llama::load(&path, WeightMode::DequantF32).unwrap();
    let text = std::fs::read_to_string("../shared/data/wikitext-2-raw-test.txt").unwrap();
    let tokens = tok.encode(&text).unwrap();
    let from = 80 * 512;
    let c = model.config.clone();
    let d = c.head_dim;
    let n = 1024;
    let mut rec = Rec { inner: Fp16Store::for_config(&c, n), kv: vec![], q: vec![] };
    model.forward(&tokens[from..from + n], &mut rec, n - 1).unwrap();
    let cbs: [ScaledCodebook; 5] = std::array::from_fn(|b| ScaledCodebook::new(b.max(1) as u32, d));
    let g = c.n_heads / c.n_kv_heads;
    let mut tot = vec![0f64; 8];
    let names = ["tq3", "tq3c", "tq3.5post", "tq3.5postc", "tq3.5postcQ", "tq4", "tq4c", "tq3.5pre_c"];
    for (l, k, _v, nt) in &rec.kv {
        let (_, q, nq) = rec.q.iter().find(|x| x.0 == *l).unwrap();
        let mut line = format!("L{l:2}");
        for h in 0..c.n_kv_heads {
            let keys: Vec<&[f32]> = k[h * nt * d..(h + 1) * nt * d].chunks(d).collect();
            let mut mu = vec![0f32; d];
            for r in &keys {
                for j in 0..d {
                    mu[j] += r[j] / *nt as f32;
                }
            }
            // query second moment M (original domain), from heads of this group
            let mut m = vec![0f64; d * d];
            let mut cnt = 0.0;
            for hq in h * g..(h + 1) * g {
                for r in q[hq * nq * d..(hq + 1) * nq * d].chunks(d) {
                    cnt += 1.0;
                    for a in 0..d {
                        for b in 0..d {
                            m[a * d + b] += (r[a] * r[b]) as f64;
                        }
                    }
                }
            }
            m.iter_mut().for_each(|x| *x /= cnt);
            let qf = |e: &[f32]| -> f64 {
                let mut s = 0.0;
                for a in 0..d {
                    let mut t = 0.0;
                    for b in 0..d {
                        t += m[a * d + b] * e[b] as f64;
                    }
                    s += t * e[a] as f64;
                }
                s
            };
            let rot = Rotation::new(d, 77 + h as u64).unwrap();
            let mut mrot = vec![0f64; d]; // diag of R M R^T
            for j in 0..d {
                let mut e = vec![0f32; d];
                e[j] = 1.0;
                rot.apply_inverse(&mut e);
                mrot[j] = qf(&e);
            }
            let denom: f64 = keys
                .iter()
                .map(|r| {
                    let e: Vec<f32> = r.iter().zip(&mu).map(|(a, b)| a - b).collect();
                    qf(&e)
                })
                .sum();
            // channel gains (MSE 3->4) post rotation, uncentered and centered
            let gains = |center: bool| -> Vec<f64> {
                let mut gsum = vec![0f64; d];
                for r in &keys {
                    let mut x: Vec<f32> = r.iter().zip(&mu).map(|(a, b)| if center { a - b } else { *a }).collect();
                    rot.apply(&mut x);
                    let e3 = quant(&x, &[3; 64][..d], &cbs, d);
                    let e4 = quant(&x, &[4; 64][..d], &cbs, d);
                    for j in 0..d {
                        gsum[j] += ((x[j] - e3[j]) as f64).powi(2) - ((x[j] - e4[j]) as f64).powi(2);
                    }
                }
                gsum
            };
            let pick = |w: &[f64]| -> Vec<u32> {
                let mut idx: Vec<usize> = (0..d).collect();
                idx.sort_by(|a, b| w[*b].partial_cmp(&w[*a]).unwrap());
                let mut bits = vec![3u32; d];
                for &i in &idx[..d / 2] {
                    bits[i] = 4;
                }
                bits
            };
            let gu = gains(false);
            let gc = gains(true);
            let gq: Vec<f64> = gc.iter().zip(&mrot).map(|(a, b)| a * b).collect();
            let schemes: Vec<(bool, Vec<u32>)> = vec![
                (false, vec![3; d]),
                (true, vec![3; d]),
                (false, pick(&gu)),
                (true, pick(&gc)),
                (true, pick(&gq)),
                (false, vec![4; d]),
                (true, vec![4; d]),
            ];
            for (si, (center, bits)) in schemes.iter().enumerate() {
                let mut err = 0.0;
                for r in &keys {
                    let mut x: Vec<f32> = r.iter().zip(&mu).map(|(a, b)| if *center { a - b } else { *a }).collect();
                    rot.apply(&mut x);
                    let mut e: Vec<f32> = quant(&x, bits, &cbs, d).iter().zip(&x).map(|(a, b)| a - b).collect();
                    rot.apply_inverse(&mut e);
                    err += qf(&e);
                }
                tot[si] += err / denom;
                if h == 0 {
                    line += &format!(" {}={:.4}", names[si], err / denom);
                }
            }
            // pre-rotation split: top-32 channel variance (centered) at 4 bits, own rot (32)
            let mut var = vec![0f64; d];
            for r in &keys {
                for j in 0..d {
                    var[j] += ((r[j] - mu[j]) as f64).powi(2);
                }
            }
            let mut idx: Vec<usize> = (0..d).collect();
            idx.sort_by(|a, b| var[*b].partial_cmp(&var[*a]).unwrap());
            let (hi, lo) = idx.split_at(d / 2);
            let r32a = Rotation::new(d / 2, 5).unwrap();
            let r32b = Rotation::new(d / 2, 6).unwrap();
            let cb32: [ScaledCodebook; 5] = std::array::from_fn(|b| ScaledCodebook::new(b.max(1) as u32, d / 2));
            let mut err = 0.0;
            for r in &keys {
                let mut e = vec![0f32; d];
                for (set, rr, b) in [(hi, &r32a, 4u32), (lo, &r32b, 3u32)] {
                    let mut x: Vec<f32> = set.iter().map(|&j| r[j] - mu[j]).collect();
                    let x0 = x.clone();
                    rr.apply(&mut x);
                    let mut qx = quant(&x, &vec![b; d / 2], &cb32, d / 2);
                    rr.apply_inverse(&mut qx);
                    for (t, &j) in set.iter().enumerate() {
                        e[j] = qx[t] - x0[t];
                    }
                }
                err += qf(&e);
            }
            tot[7] += err / denom;
            if h == 0 {
                line += &format!(" {}={:.4}", names[7], err / denom);
            }
        }
        println!("{line}");
    }
    let nn = (c.n_layers * c.n_kv_heads) as f64;
    for (i, t) in tot.iter().enumerate() {
        println!("{} mean rel score err {:.4}", names[i], t / nn);
    }
}

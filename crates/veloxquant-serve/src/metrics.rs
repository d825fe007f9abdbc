//! Counters and gauges shared by the HTTP layer and the scheduler, rendered as Prometheus
//! text at `/metrics`.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

macro_rules! metrics {
    ($($name:ident: $kind:literal, $help:literal;)*) => {
        /// Every metric; names are `veloxquant_<field>`.
        #[derive(Default, Debug)]
        pub struct Metrics {
            $(pub $name: AtomicU64,)*
        }

        impl Metrics {
            /// Prometheus text exposition format (version 0.0.4).
            pub fn render(&self) -> String {
                let mut s = String::new();
                $(
                    let _ = writeln!(s, "# HELP veloxquant_{} {}", stringify!($name), $help);
                    let _ = writeln!(s, "# TYPE veloxquant_{} {}", stringify!($name), $kind);
                    let _ = writeln!(s, "veloxquant_{} {}", stringify!($name), self.$name.load(Relaxed));
                )*
                s
            }
        }
    };
}

metrics! {
    requests_total: "counter", "Completion requests received (every endpoint that generates).";
    requests_failed_total: "counter", "Requests answered with an error (including rejections).";
    requests_cancelled_total: "counter", "Requests whose client went away before the end.";
    requests_rejected_total: "counter", "Requests refused with 503 (queue full or shutting down).";
    prompt_tokens_total: "counter", "Prompt tokens of admitted requests.";
    prefill_tokens_total: "counter", "Prompt tokens actually run through the model (prefix hits excluded).";
    generated_tokens_total: "counter", "Tokens generated.";
    prefix_cache_hits_total: "counter", "Requests that started from cached prefix pages.";
    prefix_cache_tokens_total: "counter", "Prompt tokens taken from the prefix cache instead of computed.";
    steps_total: "counter", "Batched forward passes.";
    step_rows_total: "counter", "Sequences over all forward passes (mean batch = this / steps_total).";
    forward_micros_total: "counter", "Microseconds spent in the engine's forward passes (the rest of the loop is scheduling; includes text_micros_total).";
    forward_micros_max: "gauge", "The slowest forward pass, in microseconds.";
    decode_steps_total: "counter", "Forward passes with no prefill rows (decode alone).";
    decode_step_rows_total: "counter", "Sequences over the decode-only forward passes.";
    decode_micros_total: "counter", "Microseconds in the decode-only forward passes (the rest of forward_micros_total ran prefill).";
    prefill_plan_micros_total: "counter", "Of the prefill-carrying passes, microseconds allocating pages and uploading the prefill's inputs (GPU engine).";
    prefill_queue_micros_total: "counter", "Of the prefill-carrying passes, microseconds queuing the prefill's kernels (GPU engine; the device runs meanwhile).";
    prefill_wait_micros_total: "counter", "Of the prefill-carrying passes, microseconds waiting for prompts' first tokens after the step's decode rows (GPU engine).";
    admit_micros_total: "counter", "Microseconds spent admitting requests (budget checks, prefix lookups, eviction).";
    output_micros_total: "counter", "Microseconds spent after forward passes (choosing, checkpoints, finishing).";
    text_micros_total: "counter", "Microseconds detokenizing and streaming running requests' tokens (during the next forward: overlapped on the GPU).";
    publish_micros_total: "counter", "Microseconds spent updating the KV gauges (when sequences come or go, else every 20 ms).";
    queue_length: "gauge", "Requests waiting for admission.";
    sequences_running: "gauge", "Sequences being prefilled or decoded.";
    kv_bytes_in_use: "gauge", "KV-cache bytes held by live sequences (shared pages once).";
    kv_bytes_cached: "gauge", "KV-cache bytes held only by the prefix cache and slots.";
    kv_bytes_fp16_equivalent: "gauge", "What the live sequences' tokens would take in an fp16 cache.";
    kv_bytes_peak: "gauge", "Highest KV-cache bytes (live + cached) seen.";
    kv_budget_bytes: "gauge", "The KV-cache budget (--kv-budget-mib).";
}

impl Metrics {
    pub fn inc(c: &AtomicU64) {
        c.fetch_add(1, Relaxed);
    }
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Relaxed);
    }
    pub fn set(c: &AtomicU64, v: u64) {
        c.store(v, Relaxed);
    }
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Relaxed)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn renders_every_name_with_type_and_value() {
        let m = super::Metrics::default();
        super::Metrics::add(&m.generated_tokens_total, 42);
        let s = m.render();
        assert!(s.contains("# TYPE veloxquant_generated_tokens_total counter\nveloxquant_generated_tokens_total 42\n"));
        for name in ["requests_total", "queue_length", "sequences_running", "kv_bytes_in_use", "kv_bytes_cached"] {
            assert!(s.contains(&format!("\nveloxquant_{name} 0\n")), "{name} missing");
        }
        assert!(
            s.contains("veloxquant_kv_bytes_fp16_equivalent 0") && s.contains("veloxquant_prefix_cache_hits_total 0")
        );
    }
}

//! Kernel launches of the device cache: table deltas, appends, the prefill window, dense
//! decoded rows. Every launch checks its buffers' extents; the rows it gets were planned by
//! `plan_append` against this cache.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{AppendRow, AppendSrc, GpuKvCache};
use crate::error::{drv, CudaError, Result};

impl GpuKvCache {
    /// Apply an uploaded delta list (`encode_deltas` layout) on `st` (graph-capturable).
    pub fn launch_deltas_from(
        &mut self,
        buf: &cudarc::driver::CudaView<'_, i32>,
        st: &Arc<cudarc::driver::CudaStream>,
    ) -> Result<()> {
        let mut l = st.launch_builder(&self.f_deltas);
        l.arg(buf).arg(&mut self.meta);
        // SAFETY: as launch_deltas; the caller's buffer holds a count and that many pairs
        // (checked by encode_deltas_into).
        unsafe { l.launch(LaunchConfig { grid_dim: (1, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }) }
            .map_err(drv("apply_deltas"))?;
        Ok(())
    }

    /// Run the appends `rows` (device array of `n_rows`) for `layer`, both streams, on `st`.
    /// `max_new` bounds every row's n (grid size); rows of ≤ 4 tokens use the one-launch path.
    #[allow(clippy::too_many_arguments)]
    pub fn launch_append(
        &mut self,
        layer: usize,
        rows: &cudarc::driver::CudaView<'_, AppendRow>,
        n_rows: usize,
        max_new: usize,
        max_enc: usize,
        ksrc: &AppendSrc<'_>,
        vsrc: &AppendSrc<'_>,
        st: &Arc<cudarc::driver::CudaStream>,
    ) -> Result<()> {
        self.check_layer(layer)?;
        if n_rows == 0 || rows.len() < n_rows {
            return Err(CudaError::ShapeMismatch { op: "append rows", expected: n_rows, got: rows.len() });
        }
        let hk = self.cfg.n_kv_heads;
        let max_pages = self.cfg.max_pages_per_seq as i32;
        let table = self.meta.slice(..self.table.len());
        let few = max_new <= 4 && max_enc <= 4 * self.cfg.page_tokens;
        let phases: &[i32] = if few { &[2] } else { &[0, 1] };
        for &phase in phases {
            for (strm, src) in [(&mut self.k, ksrc), (&mut self.v, vsrc)] {
                let items = if phase == 0 { max_enc } else { max_new } * hk;
                let cfg = if phase == 2 {
                    LaunchConfig {
                        grid_dim: (1, n_rows as u32, 1),
                        block_dim: (32 * hk.min(32) as u32, 1, 1),
                        shared_mem_bytes: 0,
                    }
                } else {
                    LaunchConfig {
                        grid_dim: (items.div_ceil(8).max(1) as u32, n_rows as u32, 1),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: 0,
                    }
                };
                let signs = super::layer_transform(&strm.signs, &strm.fmt, layer, hk);
                let stride = src.stride as i64;
                let mut l = st.launch_builder(&strm.f_append);
                l.arg(rows)
                    .arg(&phase)
                    .arg(&src.data)
                    .arg(&stride)
                    .arg(&mut strm.exact[layer])
                    .arg(&mut strm.pools[layer])
                    .arg(&table)
                    .arg(&max_pages)
                    .arg(&signs)
                    .arg(&strm.rot_scale)
                    .arg(&strm.thresholds)
                    .arg(&strm.centroids);
                // SAFETY: matches kv_append (kernels/kv.cu). Every row was planned by
                // plan_append against this cache (slots, pages allocated in the table), the
                // source holds src_row + n rows of `stride` f32 with n_kv·d used per row
                // (checked by the callers through source_rows).
                unsafe { l.launch(cfg) }.map_err(drv("kv_append"))?;
            }
        }
        Ok(())
    }

    /// The exact window before an append and its new tokens, `[kv][ld][d]` f16 per stream
    /// (prefill's band). Must run before `launch_append`.
    #[allow(clippy::too_many_arguments)]
    pub fn launch_window(
        &self,
        layer: usize,
        rows: &cudarc::driver::CudaView<'_, AppendRow>,
        width: usize,
        ksrc: &AppendSrc<'_>,
        vsrc: &AppendSrc<'_>,
        kout: &mut CudaSlice<u16>,
        vout: &mut CudaSlice<u16>,
        ld: usize,
        st: &Arc<cudarc::driver::CudaStream>,
    ) -> Result<()> {
        self.check_layer(layer)?;
        let hk = self.cfg.n_kv_heads;
        let need = hk * ld * self.cfg.head_dim;
        if kout.len() < need || vout.len() < need || width > ld {
            return Err(CudaError::ShapeMismatch {
                op: "window buffers",
                expected: need,
                got: kout.len().min(vout.len()),
            });
        }
        for (strm, src, out) in [(&self.k, ksrc, kout), (&self.v, vsrc, vout)] {
            let cfg = LaunchConfig {
                grid_dim: ((width * hk).div_ceil(8).max(1) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let (stride, ldl) = (src.stride as i64, ld as i64);
            let mut l = st.launch_builder(&strm.f_window);
            l.arg(rows).arg(&src.data).arg(&stride).arg(&strm.exact[layer]).arg(out).arg(&ldl);
            // SAFETY: matches kv_window; the row was planned against this cache, `out` holds
            // hk·ld·d ≥ hk·width·d values (checked above).
            unsafe { l.launch(cfg) }.map_err(drv("kv_window"))?;
        }
        Ok(())
    }

    /// Positions [0, n_end) of `slot` decoded to dense f16 `[kv][ld][d]` per stream, in the
    /// original domain (prefill's keys and values).
    #[allow(clippy::too_many_arguments)]
    pub fn launch_dense(
        &self,
        layer: usize,
        slot: usize,
        kout: &mut CudaSlice<u16>,
        vout: &mut CudaSlice<u16>,
        ld: usize,
        st: &Arc<cudarc::driver::CudaStream>,
    ) -> Result<()> {
        self.check_layer(layer)?;
        let s = self.slot(slot)?;
        let (n_end, coded) = (s.n_tokens, s.coded);
        let hk = self.cfg.n_kv_heads;
        let need = hk * ld * self.cfg.head_dim;
        if kout.len() < need || vout.len() < need || n_end > ld {
            return Err(CudaError::ShapeMismatch {
                op: "dense buffers",
                expected: need,
                got: kout.len().min(vout.len()),
            });
        }
        let table = self.meta.slice(..self.table.len());
        let max_pages = self.cfg.max_pages_per_seq as i32;
        for (strm, out) in [(&self.k, kout), (&self.v, vout)] {
            let cfg = LaunchConfig {
                grid_dim: ((n_end * hk).div_ceil(8).max(1) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let signs = super::layer_transform(&strm.signs, &strm.fmt, layer, hk);
            let (sl, ne, cd, ldl) = (slot as i32, n_end as i32, coded as i32, ld as i64);
            let mut l = st.launch_builder(&strm.f_dense);
            l.arg(&sl)
                .arg(&ne)
                .arg(&cd)
                .arg(&strm.exact[layer])
                .arg(&strm.pools[layer])
                .arg(&table)
                .arg(&max_pages)
                .arg(&signs)
                .arg(&strm.rot_scale)
                .arg(&strm.centroids)
                .arg(out)
                .arg(&ldl);
            // SAFETY: matches kv_dense; the slot's table rows cover its coded tokens, `out`
            // holds hk·ld·d ≥ hk·n_end·d values (checked above).
            unsafe { l.launch(cfg) }.map_err(drv("kv_dense"))?;
        }
        Ok(())
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer >= self.cfg.n_layers {
            return Err(CudaError::ShapeMismatch { op: "cache layer", expected: self.cfg.n_layers, got: layer });
        }
        Ok(())
    }
}

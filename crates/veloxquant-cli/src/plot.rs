//! SVG scatter plots (plotters): one point series per format family, optional curves.

use std::path::Path;

use plotters::prelude::*;

use crate::util::AnyResult;

pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    /// ± error of each point's y (drawn as a bar), empty for none.
    pub y_err: Vec<f64>,
}

impl Series {
    pub fn new(label: impl Into<String>) -> Self {
        Self { label: label.into(), points: Vec::new(), y_err: Vec::new() }
    }
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// Scatter `series` (and `curves` as lines) into an SVG; `log_y` for error axes.
pub fn scatter_svg(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    curves: &[(&str, Vec<(f64, f64)>)],
    log_y: bool,
) -> AnyResult {
    if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    // Error bar ends count as points for the axis range.
    let ends: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().zip(&s.y_err).flat_map(|(&(x, y), &e)| [(x, y - e), (x, y + e)]))
        .collect();
    let all = series.iter().flat_map(|s| s.points.iter()).chain(curves.iter().flat_map(|c| c.1.iter())).chain(&ends);
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in all {
        if log_y && y <= 0.0 {
            continue;
        }
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    let pad = (x1 - x0).max(1e-9) * 0.05;
    // Drawn into memory, then written through a temporary file (files.rs).
    let mut svg = String::new();
    let root = SVGBackend::with_string(&mut svg, (900, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut b = ChartBuilder::on(&root);
    b.caption(title, ("sans-serif", 22)).margin(15).x_label_area_size(45).y_label_area_size(70);
    macro_rules! draw {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart.configure_mesh().x_desc(x_label).y_desc(y_label).draw()?;
            for (i, (label, pts)) in curves.iter().enumerate() {
                let c = RGBColor(90 + 40 * i as u8, 90, 90);
                chart
                    .draw_series(LineSeries::new(pts.iter().cloned(), c.stroke_width(2)))?
                    .label(*label)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c));
            }
            for (i, s) in series.iter().enumerate() {
                let c = COLORS[i % COLORS.len()];
                let pts: Vec<(f64, f64)> = s.points.iter().cloned().filter(|p| !log_y || p.1 > 0.0).collect();
                let cap = (x1 - x0).max(1e-9) * 0.006;
                for (&(x, y), &e) in s.points.iter().zip(&s.y_err).filter(|(p, _)| !log_y || p.1 > 0.0) {
                    let (lo, hi) = (if log_y { (y - e).max(y * 0.1) } else { y - e }, y + e);
                    let bar = [
                        vec![(x, lo), (x, hi)],
                        vec![(x - cap, lo), (x + cap, lo)],
                        vec![(x - cap, hi), (x + cap, hi)],
                    ];
                    chart.draw_series(bar.into_iter().map(|p| PathElement::new(p, c.stroke_width(1))))?;
                }
                chart
                    .draw_series(pts.iter().map(|&p| Circle::new(p, 5, c.filled())))?
                    .label(s.label.clone())
                    .legend(move |(x, y)| Circle::new((x + 9, y), 5, c.filled()));
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperRight)
                .draw()?;
        }};
    }
    if log_y {
        draw!(b.build_cartesian_2d((x0 - pad)..(x1 + pad), ((y0 * 0.7)..(y1 * 1.4)).log_scale())?);
    } else {
        let ypad = (y1 - y0).max(1e-9) * 0.08;
        draw!(b.build_cartesian_2d((x0 - pad)..(x1 + pad), (y0 - ypad)..(y1 + ypad))?);
    }
    root.present()?;
    drop(root);
    crate::files::write_atomic(path, |w| Ok(std::io::Write::write_all(w, svg.as_bytes())?))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

//! The per-rank memory arithmetic of the DDP-vs-FSDP chapter, computed (not typed in) for
//! BasicNet at a given fc1 width and world size: parameters, gradients and AdamW state per rank
//! for DDP and the ZeRO stages, with FSDP's padding of each FlatParameter to a multiple of the
//! world size.
//!
//! BasicNet's layers (as `ladder_core::model::BasicNet::num_parameters`): conv1 1→32 3×3 (320),
//! conv2 32→64 3×3 (18,496), fc1 9216→w (9216·w + w), fc2 w→10 (10·w + 10).

/// Bytes of one f32.
const F32: u64 = 4;

/// BasicNet's layers at fc1 width `width`: (name, parameters), in definition order.
pub fn layers(width: u64) -> [(&'static str, u64); 4] {
    [("conv1", 32 * 9 + 32), ("conv2", 64 * 32 * 9 + 64), ("fc1", 9216 * width + width), ("fc2", width * 10 + 10)]
}

/// Total parameters at `width` (1,199,882 at 128).
pub fn num_parameters(width: u64) -> u64 {
    layers(width).iter().map(|(_, n)| n).sum()
}

/// `n` rounded up to a multiple of `w` (FSDP's `padded_numel`).
pub fn padded(n: u64, w: u64) -> u64 {
    n.div_ceil(w) * w
}

/// Per-rank bytes of model state, fp32 with AdamW (two moments per parameter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PerRank {
    /// Persistent parameters.
    pub parameters: u64,
    /// Persistent gradients.
    pub gradients: u64,
    /// AdamW `exp_avg` + `exp_avg_sq`.
    pub optimizer: u64,
    /// Transient full parameters alive at once during forward/backward (beyond `parameters`),
    /// with FULL_SHARD's backward prefetch (`BACKWARD_PRE`, PyTorch's default).
    pub gathered: u64,
    /// The same without prefetch (`NO_PREFETCH`, Accelerate's and Transformers' default).
    pub gathered_no_prefetch: u64,
}

impl PerRank {
    /// Parameters + gradients + optimizer state.
    pub fn persistent(&self) -> u64 {
        self.parameters + self.gradients + self.optimizer
    }
}

/// One row of the arithmetic: a scheme and its per-rank bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// `DDP`, `ZeRO-1`, …
    pub scheme: &'static str,
    /// What it is in this project.
    pub here: &'static str,
    /// The bytes.
    pub bytes: PerRank,
}

/// The rows for BasicNet at `width` on `w` ranks, FSDP wrapping every layer in its own
/// FlatParameter (`--fsdp-min-num-params 0`, what the bench runs).
pub fn rows(width: u64, w: u64) -> Vec<Row> {
    let n = num_parameters(width);
    let shard: u64 = layers(width).iter().map(|(_, p)| padded(*p, w) / w).sum();
    let (largest_pair, largest) = (gathered_pair(width, w).2, largest_unit(width, w));
    let all_units: u64 = layers(width).iter().map(|(_, p)| padded(*p, w)).sum();
    vec![
        Row {
            scheme: "DDP",
            here: "`ddp`, `fsdp-no-shard`",
            bytes: PerRank { parameters: F32 * n, gradients: F32 * n, optimizer: 2 * F32 * n, gathered: 0, gathered_no_prefetch: 0 },
        },
        Row {
            scheme: "ZeRO-1",
            here: "not implemented",
            bytes: PerRank { parameters: F32 * n, gradients: F32 * n, optimizer: 2 * F32 * shard, gathered: 0, gathered_no_prefetch: 0 },
        },
        Row {
            scheme: "ZeRO-2 · SHARD_GRAD_OP",
            here: "`fsdp-shard-grad-op`",
            bytes: PerRank {
                parameters: F32 * shard,
                gradients: F32 * shard,
                optimizer: 2 * F32 * shard,
                gathered: F32 * all_units,
                gathered_no_prefetch: F32 * all_units,
            },
        },
        Row {
            scheme: "ZeRO-3 · FULL_SHARD",
            here: "`fsdp-full-shard`",
            bytes: PerRank {
                parameters: F32 * shard,
                gradients: F32 * shard,
                optimizer: 2 * F32 * shard,
                gathered: F32 * largest_pair,
                gathered_no_prefetch: F32 * largest,
            },
        },
    ]
}

/// FULL_SHARD's backward holds the unit it computes and, with `BACKWARD_PRE` (PyTorch's default
/// and level 1's), the unit backward needs next, prefetched meanwhile: the largest sum of two
/// neighbouring units. Returns their names and that sum of (padded) parameters — fc1 and conv2
/// at width 128, fc1 and fc2 at width 4096, where fc2 (10·w + 10) outgrows conv2.
pub fn gathered_pair(width: u64, w: u64) -> (&'static str, &'static str, u64) {
    let l = layers(width);
    (0..l.len() - 1).map(|i| (l[i].0, l[i + 1].0, padded(l[i].1, w) + padded(l[i + 1].1, w))).max_by_key(|p| p.2).unwrap_or(("", "", 0))
}

/// The largest unit's (padded) parameters: what FULL_SHARD holds gathered at once without
/// prefetch.
pub fn largest_unit(width: u64, w: u64) -> u64 {
    layers(width).iter().map(|(_, p)| padded(*p, w)).max().unwrap_or(0)
}

/// Bytes one rank sends per training step for the gradient and parameter collectives, with the
/// ring algorithms of NCCL and of Open MPI for large messages: an all-reduce of S bytes sends
/// 2(W−1)/W · S, an all-gather or a reduce-scatter of S (the full buffer) (W−1)/W · S. DDP
/// all-reduces the gradients once; SHARD_GRAD_OP all-gathers the parameters once and
/// reduce-scatters the gradients; FULL_SHARD all-gathers twice (forward, then backward).
/// Returns (scheme, payload bytes as the bench's `comm KiB/step` counts them, bytes sent).
pub fn wire(width: u64, w: u64) -> Vec<(&'static str, u64, u64)> {
    let dense = F32 * num_parameters(width);
    let flat: u64 = F32 * layers(width).iter().map(|(_, p)| padded(*p, w)).sum::<u64>();
    let part = |s: u64| s * (w - 1) / w;
    vec![("DDP", dense, 2 * part(dense)), ("SHARD_GRAD_OP", 2 * flat, 2 * part(flat)), ("FULL_SHARD", 3 * flat, 3 * part(flat))]
}

fn kib(bytes: u64) -> String {
    thousands((bytes as f64 / 1024.0).round() as u64)
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1024.0 * 1024.0))
}

/// `n` with a comma between each group of three digits (1,199,882).
pub(crate) fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The Markdown of the arithmetic for `widths` × `world_sizes`.
pub fn markdown(widths: &[u64], world_sizes: &[u64]) -> String {
    let mut out = String::from(
        "<!-- generated by `book-check memory`; do not edit -->\n\n\
         BasicNet's parameters by layer (fc1's width w; f32, 4 bytes each):\n\n\
         | layer | parameters |",
    );
    for &width in widths {
        out.push_str(&format!(" w = {width} |"));
    }
    out.push_str("\n|---|---|");
    out.push_str(&"---:|".repeat(widths.len()));
    out.push('\n');
    let formulas = ["32·1·3·3 + 32", "64·32·3·3 + 64", "9216·w + w", "10·w + 10"];
    for (i, formula) in formulas.iter().enumerate() {
        out.push_str(&format!("| {} | {formula} |", layers(128)[i].0));
        for &width in widths {
            out.push_str(&format!(" {} |", thousands(layers(width)[i].1)));
        }
        out.push('\n');
    }
    out.push_str("| **total** | |");
    for &width in widths {
        out.push_str(&format!(" **{}** ({} MiB) |", thousands(num_parameters(width)), mib(F32 * num_parameters(width))));
    }
    out.push_str("\n\n");
    out.push_str(
        "The schemes: **DDP** (here `ddp`, and `fsdp-no-shard`, FSDP's code path with DDP's memory); **ZeRO-1**, the \
         optimizer state sharded (PyTorch's `ZeroRedundancyOptimizer` over DDP: `--zero-redundancy-optimizer`); **ZeRO-2**, the gradients \
         too (`fsdp-shard-grad-op`); **ZeRO-3**, the parameters too (`fsdp-full-shard`). FSDP keeps one FlatParameter \
         per layer, padded to a multiple of the ranks. *Persistent* is what a rank holds throughout; *+ gathered* what a \
         sharded scheme holds on top while it computes: with backward prefetch / without, where they differ.\n\n",
    );
    for &width in widths {
        for &w in world_sizes {
            out.push_str(&format!(
                "Per rank at w = {width}, {w} ranks, MiB:\n\n\
                 | scheme | parameters | gradients | AdamW state | persistent | + gathered |\n\
                 |---|---:|---:|---:|---:|---:|\n"
            ));
            for r in rows(width, w) {
                let b = r.bytes;
                let gathered = match (b.gathered, b.gathered_no_prefetch) {
                    (0, 0) => "—".to_string(),
                    (a, n) if a == n => mib(a),
                    (a, n) => format!("{} / {}", mib(a), mib(n)),
                };
                out.push_str(&format!(
                    "| {} | {} | {} | {} | {} | {gathered} |\n",
                    r.scheme,
                    mib(b.parameters),
                    mib(b.gradients),
                    mib(b.optimizer),
                    mib(b.persistent()),
                ));
            }
            out.push('\n');
        }
    }
    // Why ZeRO-2's and ZeRO-3's rows agree here.
    let shares: Vec<String> = widths
        .iter()
        .map(|&w| {
            let (a, b, _) = gathered_pair(w, 2);
            format!("{:.1}% at w = {w} (the prefetched pair: {a} + {b})", 100.0 * layers(w)[2].1 as f64 / num_parameters(w) as f64)
        })
        .collect();
    out.push_str(&format!(
        "ZeRO-2's and ZeRO-3's rows agree to the printed digit: fc1 alone is {} of BasicNet's parameters, so the one or \
         two units FULL_SHARD holds at once are nearly the whole model that SHARD_GRAD_OP holds from forward to backward. \
         On a model of many similar layers the two would differ by about the number of units.\n\n",
        shares.join(" and ")
    ));
    for &width in widths {
        for &w in world_sizes {
            out.push_str(&format!(
                "Collective bytes per step at w = {width}, {w} ranks, KiB (ring algorithms):\n\n\
                 | strategy | payload (the bench's comm KiB/step) | sent by each rank | vs DDP |\n|---|---:|---:|---:|\n"
            ));
            let rows = wire(width, w);
            let ddp = rows[0].2.max(1) as f64;
            for (scheme, payload, sent) in rows {
                out.push_str(&format!("| {scheme} | {} | {} | {:.2}× |\n", kib(payload), kib(sent), sent as f64 / ddp));
            }
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basicnet_counts() {
        assert_eq!(num_parameters(128), 1_199_882);
        assert_eq!(num_parameters(4096), 37_812_618);
    }

    #[test]
    fn shards_match_the_fsdp_explain_snapshot() {
        // shared/tests/snapshots/fsdp__explain_per_layer_w2.snap: 599,941 elements per rank.
        let r = rows(128, 2);
        assert_eq!(r[3].bytes.parameters, 4 * 599_941);
        assert_eq!(r[0].bytes.persistent(), 16 * 1_199_882);
        // FULL_SHARD's gathered peak: fc1 and conv2 (prefetched), as fsdp.rs's rank_memory;
        // fc1 alone without prefetch.
        assert_eq!(r[3].bytes.gathered, 4 * (1_179_776 + 18_496));
        assert_eq!(r[3].bytes.gathered_no_prefetch, 4 * 1_179_776);
        // At width 4096 fc2 (40,970) outgrows conv2 (18,496): fc1 + fc2.
        assert_eq!(gathered_pair(4096, 2), ("fc1", "fc2", 37_752_832 + 40_970));
        // fc2's 1,290 pad to 1,292 at 4 ranks.
        assert_eq!(padded(1290, 4), 1292);
    }

    #[test]
    fn bytes_on_the_wire() {
        // DDP all-reduces 4·Ψ; at 2 ranks each sends half of it twice.
        let w = wire(128, 2);
        assert_eq!(w[0], ("DDP", 4 * 1_199_882, 4 * 1_199_882));
        // FULL_SHARD: three collectives of the flat (padded) parameters, 1.5× DDP's bytes.
        let flat = 4 * 1_199_882; // every layer's count is even: no padding at 2 ranks
        assert_eq!(w[2], ("FULL_SHARD", 3 * flat, 3 * flat / 2));
        assert_eq!(w[1].2, w[0].2);
    }

    #[test]
    fn thousands_separators() {
        assert_eq!(thousands(1_199_882), "1,199,882");
        assert_eq!(thousands(320), "320");
    }
}

//! Unit planning and the `FlatParameter` layout: which parameters form a unit
//! (`size_based_auto_wrap_policy`), their offsets in the flat parameter, its padding and each
//! rank's shard — pure functions of the model and the world size, no communication.

use crate::model::Segmented;
use crate::parallel::ShardingStrategy;
use crate::{Error, Result};
use tch::{nn, Tensor};

/// The layout of one wrapped unit's `FlatParameter`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatParamUnit {
    /// Module path of the layer this unit wraps (`fc1`); empty for the root unit.
    pub name: String,
    /// Segments of the model whose parameters belong to this unit, ascending.
    pub segments: Vec<usize>,
    /// Indices into `named_parameters()`, in flattening (definition) order.
    pub params: Vec<usize>,
    /// Names of those parameters.
    pub param_names: Vec<String>,
    /// Their shapes.
    pub shapes: Vec<Vec<i64>>,
    /// Offset of each parameter in the flat parameter, elements.
    pub offsets: Vec<i64>,
    /// Elements of the unpadded flat parameter.
    pub numel: i64,
    /// Elements after padding to a multiple of the world size (`numel` for `NoShard`).
    pub padded_numel: i64,
    /// Elements each rank keeps: `padded_numel / W` (`numel` for `NoShard`).
    pub shard_numel: i64,
    /// Bytes per element of the parameters (the shard's dtype).
    pub elt_size: usize,
}

impl FlatParamUnit {
    /// The name shown in tables: the module path, or `(root)`.
    pub fn display_name(&self) -> &str {
        if self.name.is_empty() {
            "(root)"
        } else {
            &self.name
        }
    }

    /// Key of this unit's shard in a sharded state dict: `fc1._flat_param`, or `_flat_param`
    /// for the root (PyTorch's local state dict naming).
    pub fn key(&self) -> String {
        if self.name.is_empty() {
            "_flat_param".to_string()
        } else {
            format!("{}._flat_param", self.name)
        }
    }

    /// `(start, len)` of rank `rank`'s shard in the padded flat parameter under `strategy`,
    /// elements: `[rank·shard_numel, (rank+1)·shard_numel)` when it shards, the whole flat
    /// parameter (`NoShard`) otherwise.
    pub fn shard_range(&self, rank: usize, strategy: ShardingStrategy) -> (i64, i64) {
        if strategy.is_sharded() {
            (rank as i64 * self.shard_numel, self.shard_numel)
        } else {
            (0, self.shard_numel)
        }
    }

    /// Bytes of one rank's shard.
    pub fn shard_bytes(&self) -> u64 {
        self.shard_numel as u64 * self.elt_size as u64
    }

    /// Parameter `k`'s slot in `flat` (this unit's flat parameter or gradient, `[numel]` or
    /// `[padded_numel]`): a view of `flat`, in the parameter's shape.
    pub(super) fn param_view(&self, flat: &Tensor, k: usize) -> Tensor {
        let n: i64 = self.shapes[k].iter().product();
        flat.narrow(0, self.offsets[k], n).view(self.shapes[k].as_slice())
    }
}

/// Groups `module`'s parameters into units as `size_based_auto_wrap_policy(min_num_params)`
/// does and lays out each unit's FlatParameter for `world_size` ranks: children in segment
/// order, then the root unit (only when some parameters are left for it).
///
/// # Errors
/// [`Error::InvalidValue`] for `world_size == 0`; [`Error::Fsdp`] (rank 0) when the model's
/// segments do not use every parameter exactly once, a segment names a parameter that does not
/// exist, or one unit mixes dtypes.
pub fn plan_units<M: Segmented + ?Sized>(
    module: &M,
    min_num_params: usize,
    strategy: ShardingStrategy,
    world_size: usize,
) -> Result<Vec<FlatParamUnit>> {
    if world_size == 0 {
        return Err(Error::invalid("world_size", 0, "at least 1 rank"));
    }
    let params = module.named_parameters();
    let seg_params = segment_params(module, &params, 0)?;
    let bad = |problem: String| Error::Fsdp { rank: 0, problem };
    // Each layer with enough parameters is its own unit; the rest go to the root.
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    let mut root = Vec::new();
    for (i, ps) in seg_params.iter().enumerate() {
        if ps.is_empty() {
            continue;
        }
        let numel: i64 = ps.iter().map(|&p| params[p].1.numel() as i64).sum();
        if numel as u64 >= min_num_params as u64 {
            groups.push((segment_name(ps, &params), vec![i]));
        } else {
            root.push(i);
        }
    }
    if !root.is_empty() {
        groups.push((String::new(), root));
    }
    let mut units = Vec::with_capacity(groups.len());
    for (name, segments) in groups {
        let mut idx: Vec<usize> = segments.iter().flat_map(|&s| seg_params[s].iter().copied()).collect();
        idx.sort_unstable();
        let kind = params[idx[0]].1.kind();
        let (mut offsets, mut shapes, mut names, mut numel) = (Vec::new(), Vec::new(), Vec::new(), 0i64);
        for &p in &idx {
            let (pname, t) = &params[p];
            if t.kind() != kind {
                return Err(bad(format!(
                    "unit {}: parameter {pname} is {:?} but {} is {kind:?}; a FlatParameter needs one dtype",
                    if name.is_empty() { "(root)" } else { &name },
                    t.kind(),
                    params[idx[0]].0
                )));
            }
            offsets.push(numel);
            shapes.push(t.size());
            names.push(pname.clone());
            numel += t.numel() as i64;
        }
        let w = world_size as i64;
        let (padded_numel, shard_numel) = if strategy.is_sharded() {
            let padded = (numel + w - 1) / w * w;
            (padded, padded / w)
        } else {
            (numel, numel)
        };
        units.push(FlatParamUnit {
            name,
            segments,
            params: idx,
            param_names: names,
            shapes,
            offsets,
            numel,
            padded_numel,
            shard_numel,
            elt_size: kind.elt_size_in_bytes(),
        });
    }
    Ok(units)
}

/// Validated `segment_params` for every segment.
pub(super) fn segment_params<M: Segmented + ?Sized>(module: &M, params: &[(String, Tensor)], rank: usize) -> Result<Vec<Vec<usize>>> {
    let bad = |problem: String| Error::Fsdp { rank, problem };
    let n = module.num_segments();
    if n == 0 {
        return Err(bad("the model has 0 segments; expected at least 1".into()));
    }
    let mut owner: Vec<Option<usize>> = vec![None; params.len()];
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let ps = module.segment_params(i);
        for &p in &ps {
            let Some(slot) = owner.get_mut(p) else {
                return Err(bad(format!("segment {i} uses parameter index {p}, but the model has {} parameters", params.len())));
            };
            if let Some(j) = *slot {
                return Err(bad(format!(
                    "parameter {} is used by segments {j} and {i}; expected each parameter in exactly one segment (no weight tying)",
                    params[p].0
                )));
            }
            *slot = Some(i);
        }
        out.push(ps);
    }
    if let Some(p) = owner.iter().position(Option::is_none) {
        return Err(bad(format!("parameter {} is used by no segment; expected every parameter in exactly one segment", params[p].0)));
    }
    Ok(out)
}

/// The module path of a segment's parameters: `fc1` for `fc1.weight`, `fc1.bias`.
fn segment_name(ps: &[usize], params: &[(String, Tensor)]) -> String {
    let mut names: Vec<&str> = Vec::new();
    for &p in ps {
        let n = params[p].0.as_str();
        let module = n.rsplit_once('.').map_or(n, |(m, _)| m);
        if !names.contains(&module) {
            names.push(module);
        }
    }
    names.join("+")
}

/// Renders a unit layout as a table, for `--explain`: one row per unit with its parameters,
/// numel, padded numel, and what each rank keeps.
pub fn explain_units(units: &[FlatParamUnit], strategy: ShardingStrategy, world_size: usize, min_num_params: usize) -> String {
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::ASCII_MARKDOWN);
    table.set_header(["unit", "parameters", "numel", "padded numel", "shard numel per rank", "bytes per rank"]);
    let (mut numel, mut padded, mut shard, mut bytes, mut count) = (0i64, 0i64, 0i64, 0u64, 0usize);
    for u in units {
        let names: Vec<String> = u.param_names.iter().zip(&u.shapes).map(|(n, s)| format!("{n} {s:?}")).collect();
        table.add_row([
            u.display_name().to_string(),
            names.join(", "),
            u.numel.to_string(),
            u.padded_numel.to_string(),
            u.shard_numel.to_string(),
            u.shard_bytes().to_string(),
        ]);
        numel += u.numel;
        padded += u.padded_numel;
        shard += u.shard_numel;
        bytes += u.shard_bytes();
        count += u.params.len();
    }
    table.add_row([
        "total".to_string(),
        format!("{count} parameter tensors"),
        numel.to_string(),
        padded.to_string(),
        shard.to_string(),
        bytes.to_string(),
    ]);
    let what = match strategy {
        ShardingStrategy::FullShard => "all-gather before forward and again before backward, reduce-scatter(Avg) gradients",
        ShardingStrategy::ShardGradOp => "all-gather before forward, keep until backward, reduce-scatter(Avg) gradients",
        ShardingStrategy::NoShard => "full parameters on every rank, all-reduce(Avg) gradients",
        ShardingStrategy::HybridShard => {
            "FULL_SHARD within the shard group, reduce-scatter(Avg) gradients there, then all-reduce(Avg) across replicas"
        }
        ShardingStrategy::HybridShardZero2 => {
            "SHARD_GRAD_OP within the shard group, reduce-scatter(Avg) gradients there, then all-reduce(Avg) across replicas"
        }
    };
    format!(
        "FSDP units: {} FlatParameter(s), sharding_strategy {strategy} ({what}), {} {world_size}, \
         size_based_auto_wrap_policy(min_num_params = {min_num_params})\n{table}",
        units.len(),
        if strategy.is_hybrid() { "shard group size" } else { "world size" }
    )
}

/// Concatenates flat pieces and zero-pads to the unit's padded numel.
pub(super) fn flatten_padded(pieces: &[Tensor], unit: &FlatParamUnit) -> Tensor {
    let mut flat = Tensor::cat(pieces, 0);
    let pad = unit.padded_numel - unit.numel;
    if pad > 0 {
        let zeros = Tensor::zeros([pad], (flat.kind(), flat.device()));
        flat = Tensor::cat(&[flat, zeros], 0);
    }
    flat
}

/// Checks `vs` holds exactly the module's parameters (same tensors, not just the same names).
pub(super) fn check_var_store(vs: &nn::VarStore, params: &[(String, Tensor)], rank: usize) -> Result<()> {
    let vars = vs.trainable_variables();
    let in_vs: std::collections::HashSet<usize> = vars.iter().map(|t| t.data_ptr() as usize).collect();
    for (name, t) in params {
        if t.numel() > 0 && !in_vs.contains(&(t.data_ptr() as usize)) {
            return Err(Error::Fsdp {
                rank,
                problem: format!(
                    "parameter {name} is not a variable of the VarStore passed in; expected the VarStore the model was built in"
                ),
            });
        }
    }
    if vars.len() != params.len() {
        return Err(Error::Fsdp {
            rank,
            problem: format!(
                "the VarStore passed in holds {} trainable variables but the model has {} parameters; \
                 expected the VarStore of this model alone",
                vars.len(),
                params.len()
            ),
        });
    }
    Ok(())
}

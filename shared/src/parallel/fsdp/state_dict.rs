//! FSDP's state dicts: the full one (gathered, unwrapped keys, on rank 0), the sharded one
//! (each rank's `FlatParameter` shards), and loading either.

use super::plan::flatten_padded;
use super::FullyShardedDataParallel;
use crate::model::Segmented;
use crate::optim::AdamW;
use crate::{Error, Result};
use std::collections::BTreeMap;
use tch::Tensor;

impl<M: Segmented> FullyShardedDataParallel<'_, M> {
    /// The full state dict, gathered (all-gather of every shard) and returned on rank 0 only, as
    /// `FULL_STATE_DICT` with `rank0_only=True`: keys and shapes exactly those of the unwrapped
    /// model's `named_parameters()` (no wrapper prefixes, padding removed), in definition
    /// order, dtype of the shards (the fp32 master weights under mixed precision). Loadable
    /// into a single-process model by name. Other ranks get `None`; every rank must call it.
    /// The tensors are views of the gathered buffers — under `NO_SHARD`, of the shards
    /// themselves: copy them to keep a snapshot across steps.
    ///
    /// # Errors
    /// Collective errors.
    pub fn full_state_dict(&self) -> Result<Option<Vec<(String, Tensor)>>> {
        let shards: Vec<Tensor> = self.shards.iter().map(|s| s.detach()).collect();
        self.gather_full(&shards)
    }

    /// Gathers tensors laid out like this rank's shards (one `[shard_numel]` tensor per unit,
    /// e.g. the shards themselves or AdamW's moments of them) into per-parameter tensors with the
    /// unwrapped model's keys and shapes, padding removed — on rank 0 (`None` elsewhere). One
    /// all-gather per unit (none for `NoShard`). Every rank must call it.
    ///
    /// # Errors
    /// [`Error::Fsdp`] when `per_unit` does not hold one shard-shaped tensor per unit; collective
    /// errors.
    pub fn gather_full(&self, per_unit: &[Tensor]) -> Result<Option<Vec<(String, Tensor)>>> {
        // Gathered within the shard group (HSDP's replicas hold the same shards); returned on
        // the job's rank 0.
        let rank = self.world.rank();
        if per_unit.len() != self.units.len() || per_unit.iter().zip(&self.units).any(|(t, u)| t.numel() as i64 != u.shard_numel) {
            return Err(Error::Fsdp {
                rank,
                problem: format!(
                    "gather_full expects one tensor of shard_numel elements per unit ({:?}), got {:?}",
                    self.units.iter().map(|u| u.shard_numel).collect::<Vec<_>>(),
                    per_unit.iter().map(|t| t.numel()).collect::<Vec<_>>()
                ),
            });
        }
        let mut per_param: Vec<Option<Tensor>> = (0..self.params.len()).map(|_| None).collect();
        tch::no_grad(|| -> Result<()> {
            for (u, unit) in self.units.iter().enumerate() {
                // CPU offload: host shards meet the device's collective on the device.
                let shard = self.on_compute_device(&per_unit[u].detach()).contiguous();
                let full = if self.config.sharding_strategy.is_sharded() {
                    let mut full = Tensor::empty([unit.padded_numel], (shard.kind(), shard.device()));
                    self.shard_pg.all_gather(&mut full, &shard)?;
                    full
                } else {
                    shard
                };
                if rank == 0 {
                    for (k, &p) in unit.params.iter().enumerate() {
                        // Views of the gathered buffer (of the shard itself under NO_SHARD):
                        // a copy would hold each unit twice while the checkpoint is written.
                        per_param[p] = Some(unit.param_view(&full, k));
                    }
                }
            }
            Ok(())
        })?;
        if rank != 0 {
            return Ok(None);
        }
        Ok(Some(self.params.iter().zip(per_param).map(|((name, _), t)| (name.clone(), t.expect("every parameter is in a unit"))).collect()))
    }

    /// The inverse of [`gather_full`](Self::gather_full): from per-parameter tensors with the
    /// unwrapped model's keys and shapes (any floating dtype), this rank's shard of each unit
    /// (`[shard_numel]`, in the shards' dtype and device). No communication.
    ///
    /// # Errors
    /// [`Error::StateDict`] naming missing, duplicated or unexpected keys, or shapes that differ.
    pub fn shard_full(&self, full: &[(String, Tensor)]) -> Result<Vec<Tensor>> {
        let map = by_key(full, "full")?;
        let expected: BTreeMap<&str, &[i64]> =
            self.units.iter().flat_map(|u| u.param_names.iter().zip(&u.shapes).map(|(n, s)| (n.as_str(), s.as_slice()))).collect();
        check_keys(&map, &expected, "full", "the unwrapped model's named_parameters()")?;
        let (rank, strategy) = (self.shard_pg.rank(), self.config.sharding_strategy);
        tch::no_grad(|| {
            self.units
                .iter()
                .enumerate()
                .map(|(u, unit)| {
                    let (kind, device) = (self.shards[u].kind(), self.shards[u].device());
                    let pieces: Vec<Tensor> =
                        unit.param_names.iter().map(|n| map[n.as_str()].to_device(device).to_kind(kind).reshape([-1])).collect();
                    let flat = flatten_padded(&pieces, unit);
                    let (start, len) = unit.shard_range(rank, strategy);
                    Ok(flat.narrow(0, start, len).copy())
                })
                .collect()
        })
    }

    /// every rank passes the same dict and keeps its own shard of it. No communication. The
    /// optimizer keeps working on the same shard tensors (they are overwritten in place).
    ///
    /// # Errors
    /// [`Error::StateDict`] naming a missing, duplicated or unexpected key, or a key whose shape
    /// differs from the model's (expected vs found).
    pub fn load_full_state_dict(&mut self, state_dict: &[(String, Tensor)]) -> Result<()> {
        let mine = self.shard_full(state_dict)?;
        self.free_all()?;
        tch::no_grad(|| -> Result<()> {
            for (shard, src) in self.shards.iter().zip(mine) {
                shard.detach().f_copy_(&src)?;
            }
            Ok(())
        })
    }

    /// The optimizer's state with the unwrapped model's keys on rank 0 (`None` elsewhere), as
    /// `FSDP.optim_state_dict` with `FULL_OPTIM_STATE_DICT`: this rank's shards' moments are
    /// gathered and unflattened to `conv1.weight.exp_avg`, `conv1.weight.exp_avg_sq` (the
    /// parameter's shape) and `conv1.weight.step` (0-d i64) per parameter — the same dict DDP
    /// gives, at any world size. Collective (one all-gather per unit and moment). Views, as
    /// [`full_state_dict`](Self::full_state_dict)'s (under `NO_SHARD`, of the live moments).
    ///
    /// # Errors
    /// Collective errors.
    pub fn optim_state_dict(&self, opt: &AdamW) -> Result<Option<Vec<(String, Tensor)>>> {
        let names: Vec<String> = self.units.iter().map(|u| u.key()).collect();
        let local = opt.try_state_dict(&names)?;
        if local.is_empty() {
            return Ok((self.world.rank() == 0).then(Vec::new));
        }
        let map: BTreeMap<String, Tensor> = local.into_iter().collect();
        let step = map[&format!("{}.step", names[0])].shallow_clone();
        let mut per_moment = Vec::new();
        for moment in ["exp_avg", "exp_avg_sq"] {
            let shards: Vec<Tensor> = names.iter().map(|n| map[&format!("{n}.{moment}")].shallow_clone()).collect();
            per_moment.push((moment, self.gather_full(&shards)?));
        }
        if self.world.rank() != 0 {
            return Ok(None);
        }
        let gathered: Vec<(&str, BTreeMap<String, Tensor>)> =
            per_moment.into_iter().map(|(k, v)| (k, v.unwrap_or_default().into_iter().collect())).collect();
        let mut out = Vec::new();
        for p in self.param_names() {
            for (moment, full) in &gathered {
                out.push((format!("{p}.{moment}"), full[&p].shallow_clone()));
            }
            out.push((format!("{p}.step"), step.copy()));
        }
        Ok(Some(out))
    }

    /// Loads what [`optim_state_dict`](Self::optim_state_dict) returned (every rank passes the
    /// same dict) into `opt`, built over this rank's shards: each moment is flattened and this
    /// rank keeps its shard of it. No communication.
    ///
    /// # Errors
    /// [`Error::StateDict`] naming a missing key, an unexpected key or a shape that differs.
    pub fn load_optim_state_dict(&self, opt: &mut AdamW, state_dict: &[(String, Tensor)]) -> Result<()> {
        let names: Vec<String> = self.units.iter().map(|u| u.key()).collect();
        if state_dict.is_empty() {
            return opt.load_state_dict(&names, &[]);
        }
        let map: BTreeMap<&str, &Tensor> = state_dict.iter().map(|(k, t)| (k.as_str(), t)).collect();
        let params = self.param_names();
        let step = params
            .first()
            .and_then(|p| map.get(format!("{p}.step").as_str()))
            .ok_or_else(|| Error::StateDict(format!("optimizer: no {}.step entry", params.first().map_or("", |s| s))))?;
        let mut local = Vec::new();
        for moment in ["exp_avg", "exp_avg_sq"] {
            let mut full = Vec::new();
            for p in &params {
                let t = map
                    .get(format!("{p}.{moment}").as_str())
                    .ok_or_else(|| Error::StateDict(format!("optimizer: missing key {p}.{moment}")))?;
                full.push((p.clone(), t.shallow_clone()));
            }
            for (name, shard) in names.iter().zip(self.shard_full(&full)?) {
                local.push((format!("{name}.{moment}"), shard));
            }
        }
        for name in &names {
            local.push((format!("{name}.step"), step.copy()));
        }
        opt.load_state_dict(&names, &local)
    }

    /// This rank's shards as a state dict (PyTorch's local state dict): one entry per unit,
    /// key [`FlatParamUnit::key`], shape `[shard_numel]`, the shard's dtype; copies.
    pub fn sharded_state_dict(&self) -> Vec<(String, Tensor)> {
        self.units.iter().zip(&self.shards).map(|(u, s)| (u.key(), s.detach().copy())).collect()
    }

    /// Loads what [`sharded_state_dict`](Self::sharded_state_dict) returned on this rank, at
    /// the same world size and wrapping. No communication.
    ///
    /// # Errors
    /// [`Error::StateDict`] naming a missing, duplicated or unexpected key or a shard whose
    /// shape differs (expected vs found; a different world size or wrapping shows up here).
    pub fn load_sharded_state_dict(&mut self, state_dict: &[(String, Tensor)]) -> Result<()> {
        let map = by_key(state_dict, "sharded")?;
        let shapes: Vec<(String, [i64; 1])> = self.units.iter().map(|u| (u.key(), [u.shard_numel])).collect();
        let expected: BTreeMap<&str, &[i64]> = shapes.iter().map(|(k, s)| (k.as_str(), s.as_slice())).collect();
        let what = format!(
            "the shards of rank {} of {} ({}, min_num_params {})",
            self.shard_pg.rank(),
            self.shard_pg.world_size(),
            self.config.sharding_strategy,
            self.config.min_num_params
        );
        check_keys(&map, &expected, "sharded", &what)?;
        self.free_all()?;
        tch::no_grad(|| -> Result<()> {
            for (u, unit) in self.units.iter().enumerate() {
                let s = &self.shards[u];
                let src = map[unit.key().as_str()].to_device(s.device()).to_kind(s.kind());
                s.detach().f_copy_(&src)?;
            }
            Ok(())
        })
    }
}

fn by_key<'a>(state_dict: &'a [(String, Tensor)], which: &str) -> Result<BTreeMap<&'a str, &'a Tensor>> {
    let mut map = BTreeMap::new();
    for (k, t) in state_dict {
        if map.insert(k.as_str(), t).is_some() {
            return Err(Error::StateDict(format!("{which} state dict holds key {k} twice; expected each key once")));
        }
    }
    Ok(map)
}

fn check_keys(map: &BTreeMap<&str, &Tensor>, expected: &BTreeMap<&str, &[i64]>, which: &str, what: &str) -> Result<()> {
    for (k, shape) in expected {
        match map.get(k) {
            None => {
                let suffix = format!(".{k}");
                let hint = match map.keys().find(|found| found.ends_with(&suffix)) {
                    Some(found) => format!("; found {found}, which looks like it carries a wrapper prefix: strip it"),
                    None => String::new(),
                };
                return Err(Error::StateDict(format!(
                    "{which} state dict is missing key {k} (expected shape {shape:?}); expected the keys of {what}{hint}"
                )));
            }
            Some(t) if t.size().as_slice() != *shape => {
                return Err(Error::StateDict(format!("{which} state dict key {k}: expected shape {shape:?}, found {:?}", t.size())))
            }
            Some(t) if !t.is_floating_point() => {
                return Err(Error::StateDict(format!("{which} state dict key {k}: expected a floating-point tensor, found {:?}", t.kind())))
            }
            Some(_) => {}
        }
    }
    if let Some(k) = map.keys().find(|k| !expected.contains_key(*k)) {
        let keys: Vec<&str> = expected.keys().copied().collect();
        return Err(Error::StateDict(format!(
            "{which} state dict has unexpected key {k}; expected the keys of {what}: {}",
            keys.join(", ")
        )));
    }
    Ok(())
}

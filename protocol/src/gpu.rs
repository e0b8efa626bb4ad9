//! What a GPU looks like to gpunode: the inventory entry a node reports about its own
//! GPUs and the short form it puts into adverts.

use serde::{Deserialize, Serialize};

/// Whether a GPU can be lent right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GpuState {
    /// Nobody uses it; it can be leased.
    Idle,
    /// A gpunode lease holds it.
    Leased,
    /// A process that is not a gpunode job runs on it: the owner is back.
    OwnerBusy,
    /// Outside the owner's lending hours: not lent now.
    OffHours,
}

impl GpuState {
    /// A short word for tables.
    pub fn label(self) -> &'static str {
        match self {
            GpuState::Idle => "idle",
            GpuState::Leased => "leased",
            GpuState::OwnerBusy => "busy",
            GpuState::OffHours => "off-hours",
        }
    }
}

/// A process seen on a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuProcess {
    /// Host process id.
    pub pid: u32,
    /// GPU memory it uses, in bytes, when the driver reports it.
    pub used_memory_bytes: Option<u64>,
    /// Its share of the GPU's compute engine (SM), percent, when the driver reports it.
    #[serde(default)]
    pub sm_util_percent: Option<u32>,
}

/// One GPU as the local inventory sees it (the `nvidia-smi` view).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// Index as the driver numbers it.
    pub index: u32,
    /// Stable identifier (`GPU-…`).
    pub uuid: String,
    /// Product name (`NVIDIA A100-SXM4-80GB`).
    pub name: String,
    /// Total memory in bytes.
    pub memory_total_bytes: u64,
    /// Memory in use in bytes.
    pub memory_used_bytes: u64,
    /// Utilization of the compute engine, percent.
    pub utilization_percent: u32,
    /// Whether MIG mode is on, if the GPU supports MIG.
    pub mig_enabled: Option<bool>,
    /// CUDA compute capability (major, minor).
    pub compute_capability: Option<(u32, u32)>,
    /// Core temperature, °C, when the driver reports it.
    #[serde(default)]
    pub temperature_c: Option<u32>,
    /// Power draw, watts, when the driver reports it.
    #[serde(default)]
    pub power_w: Option<u32>,
    /// Uncorrected ECC errors since the driver loaded, when ECC is on.
    #[serde(default)]
    pub ecc_uncorrected: Option<u64>,
    /// Processes running on it.
    pub processes: Vec<GpuProcess>,
    /// Whether it can be lent.
    pub state: GpuState,
    /// True for simulated GPUs of test networks.
    pub simulated: bool,
}

/// The MIG profile of a MIG instance's name (`NVIDIA H200 MIG 1g.18gb` → `1g.18gb`);
/// `None` for a whole GPU.
pub fn mig_profile(name: &str) -> Option<&str> {
    let at = name.find(" MIG ")?;
    Some(name[at + 5..].trim()).filter(|p| !p.is_empty())
}

/// The family a GPU product name belongs to, used for matching and capability keys:
/// `NVIDIA A100-SXM4-80GB` and `A100-80GB` are both `A100`, `NVIDIA GeForce RTX 4090` is
/// `RTX4090`, `Tesla T4` is `T4`.
pub fn model_family(name: &str) -> String {
    let upper = name.to_ascii_uppercase();
    let tokens: Vec<&str> = upper
        .split([' ', '-', '_'])
        .filter(|t| !t.is_empty() && !matches!(*t, "NVIDIA" | "TESLA" | "GEFORCE"))
        .collect();
    match tokens.as_slice() {
        [] => upper.trim().to_string(),
        [first, second, ..] if matches!(*first, "RTX" | "GTX" | "QUADRO" | "TITAN") => {
            format!("{first}{second}")
        }
        [first, ..] => first.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::model_family;

    #[test]
    fn families() {
        assert_eq!(model_family("NVIDIA A100-SXM4-80GB"), "A100");
        assert_eq!(model_family("A100-80GB"), "A100");
        assert_eq!(model_family("a100"), "A100");
        assert_eq!(model_family("Tesla T4"), "T4");
        assert_eq!(model_family("NVIDIA GeForce RTX 4090"), "RTX4090");
        assert_eq!(model_family("NVIDIA H200"), "H200");
        assert_eq!(model_family("NVIDIA H200 MIG 1g.18gb"), "H200");
        assert_eq!(
            super::mig_profile("NVIDIA H200 MIG 1g.18gb"),
            Some("1g.18gb")
        );
        assert_eq!(super::mig_profile("NVIDIA H200"), None);
    }
}

//! `gpunode offers`: the providers offering what the flags ask for, from the daemon or
//! from a short-lived client node.

use std::process::ExitCode;

use anyhow::Result;
use gpunode_node::api::OffersQuery;
use gpunode_node::{DataDir, NodeConfig, OfferView};
use gpunode_protocol::advert::OfferFilter;

use crate::args::OffersArgs;
use crate::helpers::{parse_size_opt, print_json};
use crate::output;
use crate::target::Target;

/// `gpunode offers`.
pub async fn offers(data_dir: DataDir, config: NodeConfig, args: OffersArgs) -> Result<ExitCode> {
    let filter = offer_filter(&args)?;
    let offers: Vec<OfferView> =
        match Target::daemon_or_network(data_dir, config, &args.net).await? {
            Target::Daemon(api) => {
                let query = query_string(&OffersQuery {
                    gpu_model: filter.gpu_model.clone(),
                    gpu_slice: filter.gpu_slice.clone(),
                    min_gpu_mem: filter.min_gpu_mem_bytes,
                    gpus: filter.gpus,
                    backend: filter.backend.clone(),
                });
                api.get_json(&format!("/v1/offers{query}")).await?
            }
            Target::Local(node) => node.once(async |h| h.find_offers(filter).await).await?,
        };
    if args.json {
        print_json(&offers)?;
    } else {
        output::print_offers(&mut std::io::stdout().lock(), &offers)?;
    }
    Ok(ExitCode::SUCCESS)
}

fn offer_filter(args: &OffersArgs) -> Result<OfferFilter> {
    Ok(OfferFilter {
        gpu_model: args.gpu_model.clone(),
        gpu_slice: args.slice.gpu_slice.clone(),
        min_gpu_mem_bytes: parse_size_opt("min-gpu-mem", args.min_gpu_mem.as_deref())?,
        gpus: args.gpus,
        backend: args.backend.clone(),
    })
}

/// `?gpu_model=...&...` for the daemon's offers endpoint; empty without filters.
fn query_string(q: &OffersQuery) -> String {
    let enc = |s: &str| -> String {
        s.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect()
    };
    let parts: Vec<String> = [
        q.gpu_model
            .as_deref()
            .map(|m| format!("gpu_model={}", enc(m))),
        q.gpu_slice
            .as_deref()
            .map(|s| format!("gpu_slice={}", enc(s))),
        q.min_gpu_mem.map(|m| format!("min_gpu_mem={m}")),
        q.gpus.map(|n| format!("gpus={n}")),
        q.backend.as_deref().map(|b| format!("backend={}", enc(b))),
    ]
    .into_iter()
    .flatten()
    .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!("?{}", parts.join("&"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_string_encodes_only_the_filters_given() {
        assert_eq!(query_string(&OffersQuery::default()), "");
        let q = OffersQuery {
            gpu_model: Some("RTX 4090".into()),
            gpu_slice: None,
            min_gpu_mem: Some(42),
            gpus: Some(2),
            backend: Some("wasm".into()),
        };
        assert_eq!(
            query_string(&q),
            "?gpu_model=RTX%204090&min_gpu_mem=42&gpus=2&backend=wasm"
        );
    }
}

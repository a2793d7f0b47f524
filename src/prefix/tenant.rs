//! Tenant salts: which namespace a tenant's prompts hash in.
//!
//! A tenant's salt is its id, or its share group's name when the config groups it with others,
//! so grouped tenants share blocks and every other pair never does. The salt never leaves the
//! process (it only seeds hashes), so it needs no secrecy.

use std::collections::HashMap;

use crate::config::TenancyConfig;

/// Maps tenant ids to namespace salts, built from [`TenancyConfig`].
#[derive(Debug, Clone, Default)]
pub struct TenantSalts {
    header: Option<String>,
    group_of: HashMap<String, String>,
}

impl TenantSalts {
    /// Salts per `config`.
    pub fn from_config(config: &TenancyConfig) -> TenantSalts {
        let mut group_of = HashMap::new();
        for group in &config.share_groups {
            for tenant in &group.tenants {
                // validate() rejects a tenant in two groups; first wins if it ever got here.
                group_of
                    .entry(tenant.clone())
                    .or_insert_with(|| group.name.clone());
            }
        }
        TenantSalts {
            header: config.header.clone(),
            group_of,
        }
    }

    /// The trusted request header naming the tenant, if tenants are configured.
    pub fn header(&self) -> Option<&str> {
        self.header.as_deref()
    }

    /// The salt for `tenant` (the header's value); `None` (no tenant, or no tenancy header
    /// configured) is the shared namespace.
    pub fn salt(&self, tenant: Option<&str>) -> Option<String> {
        self.header.as_ref()?;
        let tenant = tenant?;
        Some(match self.group_of.get(tenant) {
            // Prefixes keep a tenant named like a group out of that group's namespace.
            Some(group) => format!("group:{group}"),
            None => format!("tenant:{tenant}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ShareGroupConfig;

    #[test]
    fn groups_share_and_everyone_else_is_isolated() {
        let salts = TenantSalts::from_config(&TenancyConfig {
            header: Some("x-tenant".into()),
            share_groups: vec![ShareGroupConfig {
                name: "acme".into(),
                tenants: vec!["acme-prod".into(), "acme-dev".into()],
            }],
        });
        assert_eq!(salts.header(), Some("x-tenant"));
        let cases: &[(Option<&str>, Option<&str>, bool)] = &[
            (Some("acme-prod"), Some("acme-dev"), true),
            (Some("acme-prod"), Some("other"), false),
            (Some("acme"), Some("acme-prod"), false),
            (Some("a"), Some("b"), false),
            (None, None, true),
            (None, Some("a"), false),
        ];
        for (a, b, same) in cases {
            assert_eq!(salts.salt(*a) == salts.salt(*b), *same, "{a:?} vs {b:?}");
        }
        // Without a header there are no tenants: everyone shares.
        let none = TenantSalts::default();
        assert_eq!(none.salt(Some("a")), None);
    }
}

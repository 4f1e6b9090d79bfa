//! Bearer tokens on the node's HTTP listeners: the gateway's API keys and `/metrics`'s token.

use axum::http::HeaderMap;
use subtle::ConstantTimeEq;

/// The token an `Authorization: Bearer <token>` header carries.
pub(crate) fn given(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
}

/// Whether `headers` carry one of `keys`. Every key is compared, each in time independent of
/// where it differs: the answer's timing says nothing of how much of a key a guess got right.
pub(crate) fn carries_one_of(headers: &HeaderMap, keys: &[String]) -> bool {
    let Some(token) = given(headers) else {
        return false;
    };
    keys.iter()
        .fold(subtle::Choice::from(0), |found, k| {
            found | k.as_bytes().ct_eq(token.as_bytes())
        })
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(axum::http::header::AUTHORIZATION, value.parse().unwrap());
        h
    }

    #[test]
    fn only_a_listed_key_as_a_bearer_token_passes() {
        let keys = ["k1".to_string(), "key-two".to_string()];
        assert!(carries_one_of(&with("Bearer key-two"), &keys));
        assert!(carries_one_of(&with("Bearer k1"), &keys));
        assert!(!carries_one_of(&with("Bearer key-tw"), &keys));
        assert!(!carries_one_of(&with("Bearer key-two2"), &keys));
        assert!(!carries_one_of(&with("Basic key-two"), &keys));
        assert!(!carries_one_of(&with("key-two"), &keys));
        assert!(!carries_one_of(&HeaderMap::new(), &keys));
        assert!(!carries_one_of(&with("Bearer k1"), &[]));
    }
}

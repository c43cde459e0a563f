"""The pure admission and client-identity policies (issue 20, majors 1 and 3)."""

from __future__ import annotations

import pytest

from prewarm.policy.admission import DEFAULT_MAX_TOKENS, Admission, admit, request_cost
from prewarm.policy.clients import client_address, client_key, networks


def test_cost_is_the_tokens_asked_for() -> None:
    assert request_cost({"max_tokens": 500}) == 500
    assert request_cost({"max_tokens": 10, "n": 3}) == 30
    assert request_cost({}) == DEFAULT_MAX_TOKENS
    for bad in (0, -3, "9", True, float("nan"), None):
        assert request_cost({"max_tokens": bad}) == DEFAULT_MAX_TOKENS


def test_the_bound_is_expected_wait_not_count() -> None:
    # 100 tokens/s, 10 s: 1,000 tokens. 200 requests of 4 tokens fit; 3 of 500 do not.
    small = {"a": 4.0 * 200}
    assert admit(4, "a", small, rate=100, max_wait_s=10).outcome is Admission.ADMIT
    big = {"a": 1000.0}
    d = admit(500, "a", big, rate=100, max_wait_s=10)
    assert d.outcome is Admission.OVER_SHARE and d.retry_after_s == 5  # 500 over the 1,000 it may hold
    assert d.expected_wait_s == 10


def test_a_newcomer_gets_in_past_the_bound_and_the_greedy_one_waits_for_the_drain() -> None:
    queued = {"greedy": 100_000.0}  # 1,000 s of work at 100 tokens/s: over any bound
    assert admit(4, "polite", queued, rate=100, max_wait_s=10).outcome is Admission.FAIR_SHARE
    queued["polite"] = 400.0  # its share is 500 of the 1,000 (two clients)
    assert admit(100, "polite", queued, rate=100, max_wait_s=10).admitted
    assert not admit(200, "polite", queued, rate=100, max_wait_s=10).admitted
    greedy = admit(500, "greedy", queued, rate=100, max_wait_s=10)
    assert greedy.outcome is Admission.OVER_SHARE
    assert greedy.retry_after_s == 999  # until the whole queue fits the bound again, at the real rate
    with pytest.raises(ValueError, match="drain rate"):
        admit(1, "a", {}, rate=0, max_wait_s=1)


def test_forwarded_for_is_believed_only_from_a_declared_proxy() -> None:
    proxies = networks(["10.0.0.0/8", "fd00::/8"])
    assert client_address("203.0.113.9", "1.2.3.4", proxies) == "203.0.113.9"  # not a proxy: ignored
    assert client_address("10.1.1.1", "198.51.100.7", proxies) == "198.51.100.7"
    # right to left: the client wrote the first hop, our proxies the last ones
    assert client_address("10.1.1.1", "6.6.6.6, 198.51.100.7, 10.2.2.2", proxies) == "198.51.100.7"
    assert client_address("10.1.1.1", "not-an-ip", proxies) == "10.1.1.1"
    assert client_address("10.1.1.1", None, proxies) == "10.1.1.1"
    assert client_key("Bearer sk-1", "1.2.3.4") == client_key("Bearer sk-1", "5.6.7.8") != client_key("Bearer sk-2", "x")
    assert client_key(None, "1.2.3.4") == "addr:1.2.3.4" and "sk-1" not in client_key("Bearer sk-1", "a")


def test_trusted_proxies_are_validated_where_settings_are_read(clean_env: pytest.MonkeyPatch) -> None:
    from prewarm.core.errors import SettingsError
    from prewarm.core.settings import Settings

    clean_env.setenv("PREWARM_GATEWAY_TRUSTED_PROXIES", "10.0.0.0/8, fd00::/8")
    assert Settings.load().gateway.trusted_proxies == ["10.0.0.0/8", "fd00::/8"]
    clean_env.setenv("PREWARM_GATEWAY_TRUSTED_PROXIES", "10.0.0.0/8,ingress")
    with pytest.raises(SettingsError, match="PREWARM_GATEWAY_TRUSTED_PROXIES.*'ingress' is not an IP network"):
        Settings.load()

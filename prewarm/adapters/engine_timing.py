"""How fast a replica generates, as the engine itself times its requests.

The speed checks compare time to first token and decode time per token. Timed from the
client they are noise on a loaded machine: the difference between a one-token request and
a longer one read 0 when the longer one happened to finish first, and a streamed request's
chunks arrive merged when the server's API process lags its engine (vLLM then sends several
tokens in one chunk), so the first-to-last chunk interval read near 0 too. Both engines time
each request themselves, from the engine's own clock, and export it on `/metrics`:

- vLLM: `vllm:time_to_first_token_seconds` and `vllm:request_time_per_output_token_seconds`
  (per request: first to last token by the engine core's timestamps, over the tokens after
  the first);
- the built-in runtime: `runtime_time_to_first_token_seconds` and
  `runtime_time_per_output_token_seconds`, the same figures.

A reading is the change of a histogram's sum over the change of its count between two
scrapes around the requests: their mean. Requests the replica served meanwhile (a stable
replica keeps its traffic during a canary's proof) are in the mean too: the figure is then
the replica's speed under its load of that minute, which is what a side-by-side comparison
asks for. vLLM records a request's timers in the step of its output loop that hands the last
tokens to the HTTP handler (unless that step carries over 128 requests' outputs), so a scrape
made after the answer sees them; a reading that saw no request is None and is left out.

Pure: the adapters scrape (`_HttpAdapter.engine_timers`, over their HTTP client and error
mapping) and this reads what they got.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


#: The histograms each engine keeps, by figure; a server exports one engine's.
TTFT = ("vllm:time_to_first_token_seconds", "runtime_time_to_first_token_seconds")
DECODE = ("vllm:request_time_per_output_token_seconds", "runtime_time_per_output_token_seconds")


@dataclass(frozen=True)
class Timers:
    """A server's cumulative timing histograms at one scrape: (sum, count) per figure."""

    ttft: tuple[float, float]
    decode: tuple[float, float]

    def since(self, before: "Timers") -> tuple[float | None, float | None]:
        """Mean time to first token and decode time per token of the requests timed since `before`
        (None: no request timed; a count that went down means the server restarted: None too)."""
        return _mean(before.ttft, self.ttft), _mean(before.decode, self.decode)


def _mean(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    count = after[1] - before[1]
    return (after[0] - before[0]) / count if count > 0 else None


def timers_from(text: str) -> Timers:
    """The timing histograms in a Prometheus exposition (pure); raises ValueError when the server
    exports neither engine's (summed over their label sets: vLLM labels them by engine and model)."""
    sums: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in TTFT + DECODE:
            acc = sums.setdefault(fam.name, [0.0, 0.0])
            for s in fam.samples:
                if s.name == fam.name + "_sum":
                    acc[0] += float(s.value)
                elif s.name == fam.name + "_count":
                    acc[1] += float(s.value)

    def pick(names: tuple[str, ...]) -> tuple[float, float]:
        got = next((sums[n] for n in names if n in sums), None)
        if got is None:
            raise ValueError(f"/metrics exports none of {', '.join(names)}")
        return got[0], got[1]

    return Timers(pick(TTFT), pick(DECODE))

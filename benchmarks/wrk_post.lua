-- wrk script of benchmarks/load.py: every request is POST /v1/completions with a short
-- prompt and max_tokens=1, so the figure measures the serving path, not generation length.
-- Usage: wrk -s wrk_post.lua URL -- MODEL
-- At the end it prints one line "WRK_JSON {...}" with exact counts (the text summary
-- rounds them), which load.py reads next to the "Non-2xx" and "Socket errors" lines.

local model = "bench"

function init(args)
   if args[1] ~= nil then
      model = args[1]
   end
   wrk.method = "POST"
   wrk.headers["Content-Type"] = "application/json"
   wrk.body = string.format('{"model":"%s","prompt":"Hello, how are you today?","max_tokens":1}', model)
end

function done(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      'WRK_JSON {"requests":%d,"duration_us":%d,"bytes":%d,"connect":%d,"read":%d,"write":%d,'
         .. '"status":%d,"timeout":%d,"p50_us":%d,"p99_us":%d,"max_us":%d}\n',
      summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
      latency:percentile(50), latency:percentile(99), latency.max))
end

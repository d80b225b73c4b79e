-- wrk script: the same non-streamed chat POST on every request, then one JSON summary line.
-- The body and the bearer key come from the environment (BENCH_WRK_BODY, BENCH_WRK_KEY), which
-- every wrk thread's Lua state can read.
wrk.method = "POST"
wrk.body = os.getenv("BENCH_WRK_BODY")
wrk.headers["Content-Type"] = "application/json"
local key = os.getenv("BENCH_WRK_KEY")
if key ~= nil and key ~= "" then
   wrk.headers["Authorization"] = "Bearer " .. key
end

function done(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      'BENCH_WRK {"requests":%d,"duration_us":%d,"bytes":%d,"connect_errors":%d,' ..
      '"read_errors":%d,"write_errors":%d,"status_errors":%d,"timeouts":%d,' ..
      '"p50_us":%d,"p90_us":%d,"p99_us":%d,"mean_us":%.1f,"max_us":%d}\n',
      summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write,
      e.status, e.timeout, latency:percentile(50), latency:percentile(90),
      latency:percentile(99), latency.mean, latency.max))
end

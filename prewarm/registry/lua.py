"""Lua scripts behind the replica registry: each state change is one atomic script.

Keys are computed in Python from `prewarm.core.keys` and passed in KEYS; the scripts only
read and write what they are given. Shared argument layout for scripts that touch the
indexes: KEYS = [hash, model set, node set, models, nodes, ready:serving, ready:warm,
loading, heartbeats, events].
"""

from __future__ import annotations

# Index maintenance shared by every script: put `rid` in exactly the zsets its state
# calls for, scored by heartbeat expiry.
_INDEX = """
local function reindex(rid, state, pool, expiry)
  redis.call('ZREM', KEYS[6], rid)
  redis.call('ZREM', KEYS[7], rid)
  redis.call('ZREM', KEYS[8], rid)
  if state == 'ready' then
    if pool == 'warm' then redis.call('ZADD', KEYS[7], expiry, rid)
    else redis.call('ZADD', KEYS[6], expiry, rid) end
  elseif state == 'pending' or state == 'loading' or state == 'warming' then
    redis.call('ZADD', KEYS[8], expiry, rid)
  end
  if state == 'retired' or state == 'failed' then
    redis.call('ZREM', KEYS[9], rid)
  else
    redis.call('ZADD', KEYS[9], expiry, rid)
  end
end
-- Note activity in Redis's own clock (KEYS[11], keys.REGISTRY_ACTIVITY); a silence longer than
-- `gap` seconds (a stall, a restart) starts a new continuous period. Returns its age in seconds.
local function activity(gap)
  local t = redis.call('TIME')
  local clock = tonumber(t[1]) + tonumber(t[2]) / 1000000
  local seen = tonumber(redis.call('HGET', KEYS[11], 'seen') or '0')
  local since = tonumber(redis.call('HGET', KEYS[11], 'since') or '0')
  if clock - seen > gap or since == 0 then
    since = clock
    redis.call('HSET', KEYS[11], 'since', since)
  end
  redis.call('HSET', KEYS[11], 'seen', clock)
  return clock - since
end
local function event(rid, from, to, reason, now)
  redis.call('XADD', KEYS[10], 'MAXLEN', '~', ARGV_MAXLEN, '*',
    'replica', rid, 'from', from, 'to', to, 'reason', reason, 'ts', now)
end
"""

#: ARGV: rid, now, ttl, maxlen, model, node, then field/value pairs of the new record.
#: Returns 1 when created (or a terminal record replaced), 0 for a duplicate.
REGISTER = (
    "local ARGV_MAXLEN = ARGV[4]\n"
    + _INDEX
    + """
local rid, now, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local cur = redis.call('HGET', KEYS[1], 'state')
if cur and cur ~= 'failed' and cur ~= 'retired' then return 0 end
redis.call('DEL', KEYS[1])
local state, pool = 'pending', 'serving'
for i = 7, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  if ARGV[i] == 'state' then state = ARGV[i + 1] end
  if ARGV[i] == 'pool' then pool = ARGV[i + 1] end
end
redis.call('HSET', KEYS[1], 'created_at', now, 'updated_at', now, 'heartbeat_at', now)
redis.call('SADD', KEYS[2], rid)
redis.call('SADD', KEYS[3], rid)
redis.call('SADD', KEYS[4], ARGV[5])
redis.call('SADD', KEYS[5], ARGV[6])
reindex(rid, state, pool, now + ttl)
event(rid, cur or '', state, 'registered', now)
return 1
"""
)

#: ARGV: rid, now, ttl, maxlen, target, reason, expected ('' for any), keep_s, then allowed from-states.
#: Returns {'ok', fields...} or {'notfound'} / {'unexpected', cur} / {'illegal', cur}.
TRANSITION = (
    "local ARGV_MAXLEN = ARGV[4]\n"
    + _INDEX
    + """
local rid, now, ttl, target, reason, expected = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[5], ARGV[6], ARGV[7]
local cur = redis.call('HGET', KEYS[1], 'state')
if not cur then return {'notfound'} end
if expected ~= '' and cur ~= expected then return {'unexpected', cur} end
local allowed = false
for i = 9, #ARGV do if ARGV[i] == cur then allowed = true end end
if not allowed then return {'illegal', cur} end
local pool = redis.call('HGET', KEYS[1], 'pool') or 'serving'
redis.call('HSET', KEYS[1], 'state', target, 'updated_at', now, 'reason', reason)
local expiry = tonumber(redis.call('HGET', KEYS[1], 'heartbeat_at') or now) + ttl
if target == 'ready' then
  redis.call('HSET', KEYS[1], 'heartbeat_at', now, 'progress', '1.0', 'phase', 'done')
  expiry = now + ttl
end
reindex(rid, target, pool, expiry)
if target == 'retired' or target == 'failed' then
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[8]))
end
event(rid, cur, target, reason, now)
local out = redis.call('HGETALL', KEYS[1])
table.insert(out, 1, 'ok')
return out
"""
)

#: ARGV: rid, now, ttl, maxlen, gap, then field/value pairs the agent holds (used if the record vanished).
#: KEYS: the index keys, then keys.REGISTRY_ACTIVITY.
#: Returns the stored fields (possibly a terminal state: the caller must stop hosting it).
HEARTBEAT = (
    "local ARGV_MAXLEN = ARGV[4]\n"
    + _INDEX
    + """
local rid, now, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
activity(tonumber(ARGV[5]))
local cur = redis.call('HGET', KEYS[1], 'state')
if cur == 'failed' or cur == 'retired' then return redis.call('HGETALL', KEYS[1]) end
local model, node = '', ''
if not cur then
  for i = 6, #ARGV, 2 do
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    if ARGV[i] == 'model' then model = ARGV[i + 1] end
    if ARGV[i] == 'node' then node = ARGV[i + 1] end
  end
  redis.call('SADD', KEYS[2], rid)
  redis.call('SADD', KEYS[3], rid)
  redis.call('SADD', KEYS[4], model)
  redis.call('SADD', KEYS[5], node)
  cur = redis.call('HGET', KEYS[1], 'state')
  event(rid, '', cur, 'restored by heartbeat', now)
end
redis.call('HSET', KEYS[1], 'heartbeat_at', now)
reindex(rid, cur, redis.call('HGET', KEYS[1], 'pool') or 'serving', now + ttl)
return redis.call('HGETALL', KEYS[1])
"""
)

#: Fail one replica whose heartbeat expired, deciding inside the script (a heartbeat that lands
#: between a read and a write cannot be overridden). KEYS: the index keys, then keys.REGISTRY_ACTIVITY.
#: ARGV: rid, now, ttl, maxlen, gap, keep_s, reason.
#: Returns 'reaped', 'alive' (heartbeat fresh), 'settling' (the registry came back from a silence less
#: than a TTL ago: live agents have not had the time to heartbeat), or 'gone' (dropped from the index).
REAP = (
    "local ARGV_MAXLEN = ARGV[4]\n"
    + _INDEX
    + """
local rid, now, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local age = activity(tonumber(ARGV[5]))
local score = redis.call('ZSCORE', KEYS[9], rid)
if not score then return 'gone' end
if tonumber(score) > now then return 'alive' end
local cur = redis.call('HGET', KEYS[1], 'state')
if not cur or cur == 'failed' or cur == 'retired' then
  redis.call('ZREM', KEYS[9], rid)
  return 'gone'
end
if age < ttl then return 'settling' end
local pool = redis.call('HGET', KEYS[1], 'pool') or 'serving'
redis.call('HSET', KEYS[1], 'state', 'failed', 'updated_at', now, 'reason', ARGV[7])
reindex(rid, 'failed', pool, tonumber(score))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[6]))
event(rid, cur, 'failed', ARGV[7], now)
return 'reaped'
"""
)

#: ARGV: rid, now, progress, phase. Returns 1 if updated, 0 if the replica is not loading.
PROGRESS = """
local cur = redis.call('HGET', KEYS[1], 'state')
if cur ~= 'pending' and cur ~= 'loading' and cur ~= 'warming' then return 0 end
redis.call('HSET', KEYS[1], 'progress', ARGV[3], 'phase', ARGV[4], 'updated_at', ARGV[2])
return 1
"""

def view_script(fields: tuple[str, ...]) -> str:
    """KEYS: ready:serving, ready:warm, loading. ARGV: now, replica hash prefix.

    Returns three lists with one tab-joined string of `fields` per replica whose heartbeat is
    fresh: one round trip and a compact reply for a routing decision. The field list is
    baked into the script so each call sends only two arguments.
    """
    names = ", ".join(f"'{f}'" for f in fields)
    return """
local out = {}
for k = 1, 3 do
  local ids = redis.call('ZRANGEBYSCORE', KEYS[k], '(' .. ARGV[1], '+inf')
  local rows = {}
  for _, rid in ipairs(ids) do
    local f = redis.call('HMGET', ARGV[2] .. rid, %s)
    if f[1] then
      for j = 1, #f do if not f[j] then f[j] = '' end end
      rows[#rows + 1] = table.concat(f, '\t')
    end
  end
  out[#out + 1] = rows
end
return out
""" % names


#: KEYS: the models set. ARGV: model-set prefix, model-set suffix, replica hash prefix.
#: Returns flat (model, state, pool, node) quadruples of every recorded replica, pruning ids whose record expired.
COUNTS = """
local out = {}
for _, model in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local setkey = ARGV[1] .. model .. ARGV[2]
  for _, rid in ipairs(redis.call('SMEMBERS', setkey)) do
    local f = redis.call('HMGET', ARGV[3] .. rid, 'state', 'pool', 'node')
    if f[1] then
      table.insert(out, model); table.insert(out, f[1]); table.insert(out, f[2] or 'serving'); table.insert(out, f[3] or '')
    else
      redis.call('SREM', setkey, rid)
    end
  end
end
return out
"""


#: One validated replica's figure (its warm latency, or an engine's TTFT or decode time per token) towards
#: the baseline. KEYS: samples list, baseline hash. ARGV: the figure, samples wanted, TTL, and the hash
#: field it is the baseline of (default `latency_s`). Returns the baseline (a string) once it exists, else false.
#: With the wanted count reached, the baseline is their median and the list is dropped: one slow
#: first replica is outvoted, and concurrent validations never record two baselines.
BASELINE_SAMPLE = """
local field = ARGV[4] or 'latency_s'
local have = redis.call('HGET', KEYS[2], field)
if have then return have end
local n = redis.call('RPUSH', KEYS[1], ARGV[1])
if n == 1 then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
local want = tonumber(ARGV[2])
if n < want then return false end
local vals = {}
for i, v in ipairs(redis.call('LRANGE', KEYS[1], 0, want - 1)) do vals[i] = tonumber(v) end
table.sort(vals)
local mid = math.floor((want + 1) / 2)
local median = vals[mid]
if want % 2 == 0 then median = (vals[mid] + vals[mid + 1]) / 2 end
local text = string.format('%.17g', median)
redis.call('HSET', KEYS[2], field, text, 'samples', want)
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('DEL', KEYS[1])
return text
"""

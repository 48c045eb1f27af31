"""The Lua scripts the shared state store runs (redis_state.py): Redis runs each alone, so an admission or a charge
is one atomic step across every gateway replica. Time is Redis's own (``TIME``)."""

#: the key's tokens in the window (one-second buckets in a hash) and its oldest bucket; ``drop`` deletes stale ones
WINDOW = """
local function window(key, now, win, drop)
  local used, oldest, sec = 0, nil, math.floor(now / 1000)
  local buckets = redis.call('HGETALL', key)
  for i = 1, #buckets, 2 do
    local s = tonumber(buckets[i])
    if s <= sec - win / 1000 then
      if drop then redis.call('HDEL', key, buckets[i]) end
    else
      used = used + tonumber(buckets[i + 1])
      if oldest == nil or s < oldest then oldest = s end
    end
  end
  return used, oldest
end
"""

ADMIT = WINDOW + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local win = tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - win)
local maxc = tonumber(ARGV[3])
if maxc > 0 then
  local n = tonumber(redis.call('GET', KEYS[3]) or '0')
  if n >= maxc then return {0, 'concurrent', 1000, n} end
end
local rpm = tonumber(ARGV[1])
if rpm > 0 then
  local n = redis.call('ZCARD', KEYS[1])
  if n >= rpm then
    local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    return {0, 'rpm', win - (now - tonumber(first[2])), n}
  end
end
local tpm = tonumber(ARGV[2])
if tpm > 0 then
  local used, oldest = window(KEYS[2], now, win, true)
  if used >= tpm then return {0, 'tpm', (oldest + win / 1000) * 1000 - now, used} end
end
local budget = tonumber(ARGV[4])
if budget > 0 then
  local spent = tonumber(redis.call('HGET', KEYS[4], 'total') or '0')
  if spent >= budget then return {0, 'budget', redis.call('PTTL', KEYS[4]), tostring(spent)} end
end
if rpm > 0 then
  redis.call('ZADD', KEYS[1], now, ARGV[5])
  redis.call('PEXPIRE', KEYS[1], win)
end
redis.call('INCR', KEYS[3])
redis.call('EXPIRE', KEYS[3], 3600)
return {1}
"""

CHARGE = """
if not redis.call('SET', KEYS[4], '1', 'NX', 'EX', 86400) then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local tokens = tonumber(ARGV[2])
if tokens > 0 and ARGV[8] == '1' then
  redis.call('HINCRBY', KEYS[1], tostring(math.floor(now / 1000)), tokens)
  redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[6]))
end
for _, k in ipairs({KEYS[2], KEYS[3]}) do
  redis.call('HINCRBY', k, 'tokens:' .. ARGV[4], tokens)
  redis.call('HINCRBYFLOAT', k, 'cost:' .. ARGV[4], ARGV[3])
end
redis.call('HINCRBYFLOAT', KEYS[2], 'total', ARGV[7])
local period = tonumber(ARGV[5])
if period > 0 and redis.call('TTL', KEYS[2]) < 0 then redis.call('EXPIRE', KEYS[2], period) end
return 1
"""

RESERVE = WINDOW + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local held_tokens, held_amount = 0, 0
for _, m in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
  local _, _, tok, amt = string.find(m, '^[^|]*|([^|]*)|([^|]*)$')
  held_tokens = held_tokens + tonumber(tok)
  held_amount = held_amount + tonumber(amt)
end
local tokens, amount = tonumber(ARGV[4]), tonumber(ARGV[5])
local win = tonumber(ARGV[6])
local tpm = tonumber(ARGV[1])
if tpm > 0 then
  local used, oldest = window(KEYS[1], now, win, false)
  if used + held_tokens + tokens > tpm then
    return {0, 'tpm', tostring(used), tostring(held_tokens), oldest and ((oldest + win / 1000) * 1000 - now) or 1000}
  end
end
local budget = tonumber(ARGV[2])
if budget > 0 then
  local spent = tonumber(redis.call('HGET', KEYS[2], 'total') or '0')
  if spent + held_amount + amount > budget then
    return {0, 'budget', tostring(spent), tostring(held_amount), redis.call('PTTL', KEYS[2])}
  end
end
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[7]), ARGV[3])
redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[7]))
return {1}
"""

RELEASE = """
local n = redis.call('DECR', KEYS[1])
if n < 0 then redis.call('SET', KEYS[1], 0) end
return n
"""

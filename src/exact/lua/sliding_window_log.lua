-- KEYS[1] = base key; ARGV = cost, limit, window_us.
-- A sorted set of admitted units scored by Redis time. Members are unique (a per-key sequence),
-- so units admitted in the same microsecond are all counted.
local limit, window = tonumber(ARGV[2]), tonumber(ARGV[3])
local log, seq = KEYS[1] .. ':log', KEYS[1] .. ':seq'
redis.call('ZREMRANGEBYSCORE', log, '-inf', now - window)
local used = redis.call('ZCARD', log)
if cost > limit then return {0, math.max(0, limit - used), -1, window} end
if used + cost > limit then
  -- The request fits once the (used + cost - limit)th oldest unit has left the window.
  local n = used + cost - limit - 1
  local e = redis.call('ZRANGE', log, n, n, 'WITHSCORES')
  local retry = window
  if e[2] then retry = tonumber(e[2]) + window - now end
  return {0, math.max(0, limit - used), retry, retry}
end
local last = redis.call('INCRBY', seq, cost)
-- ZADD in chunks: Lua's unpack has a small limit on values.
local args = {}
for i = last - cost + 1, last do
  args[#args + 1] = now
  args[#args + 1] = id(i)
  if #args == 512 or i == last then
    redis.call('ZADD', log, unpack(args))
    args = {}
  end
end
redis.call('PEXPIRE', log, ms(window))
redis.call('PEXPIRE', seq, ms(window))
local oldest = redis.call('ZRANGE', log, 0, 0, 'WITHSCORES')
local reset = window
if oldest[2] then reset = tonumber(oldest[2]) + window - now end
return {1, limit - used - cost, 0, reset}

-- KEYS[1] = base key; ARGV = cost, limit, window_us. Read only: what sliding_window_log.lua
-- would answer now, writing nothing (`explain`): units that left the window are skipped, not
-- removed.
local limit, window = tonumber(ARGV[2]), tonumber(ARGV[3])
local log = KEYS[1] .. ':log'
local after = '(' .. id(now - window)
local used = redis.call('ZCOUNT', log, after, '+inf')
if cost > limit then return {0, math.max(0, limit - used), -1, window} end
if used + cost > limit then
  local n = used + cost - limit - 1
  local e = redis.call('ZRANGEBYSCORE', log, after, '+inf', 'WITHSCORES', 'LIMIT', n, 1)
  local retry = window
  if e[2] then retry = tonumber(e[2]) + window - now end
  return {0, math.max(0, limit - used), retry, retry}
end
local oldest = redis.call('ZRANGEBYSCORE', log, after, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
local reset = window
if oldest[2] then reset = tonumber(oldest[2]) + window - now end
return {1, limit - used - cost, 0, reset}

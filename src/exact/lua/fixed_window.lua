-- KEYS[1] = base key; ARGV = cost, limit, window_us.
-- One counter per window index; the increment and its expiry happen in this one script, so a
-- crash between them cannot leave a counter that never expires.
local limit, window = tonumber(ARGV[2]), tonumber(ARGV[3])
local idx = math.floor(now / window)
local ends_in = (idx + 1) * window - now
if cost > limit then return {0, 0, -1, ends_in} end
local k = KEYS[1] .. ':fw:' .. id(idx)
local used = tonumber(redis.call('GET', k) or '0')
if used + cost > limit then
  return {0, math.max(0, limit - used), ends_in, ends_in}
end
used = redis.call('INCRBY', k, cost)
redis.call('PEXPIRE', k, ms(ends_in))
return {1, limit - used, 0, ends_in}

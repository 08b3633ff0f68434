-- KEYS[1] = base key; ARGV = cost, limit, window_us. Read only: what fixed_window.lua would
-- answer now, writing nothing (`explain`).
local limit, window = tonumber(ARGV[2]), tonumber(ARGV[3])
local idx = math.floor(now / window)
local ends_in = (idx + 1) * window - now
if cost > limit then return {0, 0, -1, ends_in} end
local used = tonumber(redis.call('GET', KEYS[1] .. ':fw:' .. id(idx)) or '0')
if used + cost > limit then
  return {0, math.max(0, limit - used), ends_in, ends_in}
end
return {1, limit - used - cost, 0, ends_in}

-- KEYS[1] = base key; ARGV = cost, emission_us, tolerance_us, burst. Read only: what gcra.lua
-- would answer now, writing nothing (`explain`).
local emission, tolerance, burst = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local k = KEYS[1] .. ':tat'
if cost > burst then return {0, 0, -1, 0} end
local tat = tonumber(redis.call('GET', k) or '0')
if tat < now then tat = now end
local ahead = tat + cost * emission - now
if ahead > tolerance + 0.001 then
  local left = math.floor((tolerance - (tat - now)) / emission + 0.001)
  return {0, math.max(0, left), math.ceil(ahead - tolerance), math.ceil(tat - now)}
end
return {1, math.max(0, math.floor((tolerance - ahead) / emission + 0.001)), 0, math.ceil(ahead)}

// A js-libp2p peer (TCP + noise + yamux, identify, ping) dials a gpunode node and prints
// what the node answered. Usage: node interop.mjs /ip4/127.0.0.1/tcp/PORT/p2p/PEER
// Node.js 20 lacks Promise.withResolvers, which current js-libp2p uses.
Promise.withResolvers ??= function () {
  let resolve, reject
  const promise = new Promise((res, rej) => { resolve = res; reject = rej })
  return { promise, resolve, reject }
}
const { createLibp2p } = await import('libp2p')
const { tcp } = await import('@libp2p/tcp')
const { noise } = await import('@chainsafe/libp2p-noise')
const { yamux } = await import('@chainsafe/libp2p-yamux')
const { identify } = await import('@libp2p/identify')
const { ping } = await import('@libp2p/ping')
const { multiaddr } = await import('@multiformats/multiaddr')

const target = multiaddr(process.argv[2])
const node = await createLibp2p({
  transports: [tcp()],
  connectionEncrypters: [noise()],
  streamMuxers: [yamux()],
  services: { identify: identify(), ping: ping() },
})
const timer = setTimeout(() => { console.error('timed out'); process.exit(3) }, 20000)
const identified = new Promise((resolve) => {
  node.addEventListener('peer:identify', (evt) => resolve(evt.detail))
})
const conn = await node.dial(target)
const rtt = await node.services.ping.ping(target)
const info = await identified
console.log(JSON.stringify({
  peer: conn.remotePeer.toString(),
  agent: info.agentVersion,
  protocols: info.protocols,
  ping_ms: rtt,
}))
clearTimeout(timer)
await node.stop()
process.exit(0)

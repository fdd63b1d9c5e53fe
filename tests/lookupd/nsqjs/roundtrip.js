// Publishes two messages to TOPIC on the broker at TCP (host:port) with nsqjs's Writer,
// reads them back with its Reader, prints them as JSON and exits 0 (1 after 30 s).
// OPTIONS is a JSON object of nsqjs options both take (tls, snappy, deflate,
// authSecret, ...); with tls, NODE_EXTRA_CA_CERTS names the CA to verify against.
const nsq = require('nsqjs')

const [address, topic, options] = process.argv.slice(2)
const opts = JSON.parse(options)
const [host, port] = [address.slice(0, address.lastIndexOf(':')),
  Number(address.slice(address.lastIndexOf(':') + 1))]
const fail = (what) => (err) => { console.error(what, err.message); process.exit(1) }
const got = []
const reader = new nsq.Reader(topic, 'c', { ...opts, nsqdTCPAddresses: [address],
  maxInFlight: 10 })
reader.on('message', (msg) => {
  got.push(msg.body.toString())
  msg.finish()
  if (got.length === 2) {
    console.log(JSON.stringify(got.sort()))
    reader.close()
    setTimeout(() => process.exit(0), 100)
  }
})
reader.on('error', fail('reader error:'))
reader.on('nsqd_connected', () => {
  const writer = new nsq.Writer(host, port, opts)
  writer.on('error', fail('writer error:'))
  writer.on('ready', () => writer.publish(topic, ['one', 'two'], (err) => {
    if (err) fail('publish failed:')(err)
  }))
  writer.connect()
})
reader.connect()
setTimeout(() => { console.error('timed out with', JSON.stringify(got)); process.exit(1) },
  30000)

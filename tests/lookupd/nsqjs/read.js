// Reads `count` messages of TOPIC/CHANNEL from the brokers nsqjs finds through the
// lookup daemon at LOOKUPD (host:port of its HTTP API), prints them as JSON, exits 0;
// exits 1 if they do not all come within 30 s.
const nsq = require('nsqjs')

const [lookupd, topic, channel, count] = process.argv.slice(2)
const got = []
const reader = new nsq.Reader(topic, channel, {
  lookupdHTTPAddresses: [lookupd],
  lookupdPollInterval: 1,
  maxInFlight: 10,
})
reader.on('message', (msg) => {
  got.push(msg.body.toString())
  msg.finish()
  if (got.length === Number(count)) {
    console.log(JSON.stringify(got.sort()))
    reader.close()
    setTimeout(() => process.exit(0), 100)
  }
})
reader.on('error', (err) => console.error('nsqjs error:', err.message))
reader.connect()
setTimeout(() => {
  console.error('timed out with', JSON.stringify(got))
  process.exit(1)
}, 30000)

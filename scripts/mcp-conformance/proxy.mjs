// Test-side proxy for the MCP clients that cannot send a bearer token themselves (the
// conformance suite, the Inspector's CLI): it forwards every request to warrend unchanged,
// streaming both ways (SSE included), and adds `Authorization: Bearer <token>`. A `Host`
// naming the proxy itself becomes warrend's address (what a direct client would send); any
// other Host, and every Origin, passes through as sent, so warrend's own guard judges them.
//
//   node proxy.mjs --upstream 127.0.0.1:PORT --token-file FILE
//
// It listens on a free loopback port and prints `listening 127.0.0.1:PORT` on stdout.
import http from "node:http";
import fs from "node:fs";

const args = process.argv.slice(2);
const opt = (name) => {
  const i = args.indexOf(name);
  if (i < 0 || i + 1 >= args.length) {
    console.error(`proxy: ${name} is required`);
    process.exit(2);
  }
  return args[i + 1];
};
const [host, port] = opt("--upstream").split(":");
const token = fs.readFileSync(opt("--token-file"), "utf8").trim();

const server = http.createServer((req, res) => {
  const headers = { ...req.headers, authorization: `Bearer ${token}` };
  const self = server.address();
  if (headers.host === `${self.address}:${self.port}` || headers.host === `localhost:${self.port}`) {
    headers.host = `${host}:${port}`;
  }
  const up = http.request(
    { host, port: Number(port), method: req.method, path: req.url, headers },
    (upRes) => {
      res.writeHead(upRes.statusCode, upRes.rawHeaders);
      upRes.pipe(res);
    },
  );
  up.on("error", (e) => {
    if (!res.headersSent) res.writeHead(502, { "content-type": "text/plain" });
    res.end(`proxy: ${e.message}`);
  });
  req.pipe(up);
  res.on("close", () => up.destroy());
});
server.listen(0, "127.0.0.1", () => {
  const a = server.address();
  console.log(`listening ${a.address}:${a.port}`);
});

// The npm `e2b` SDK, unchanged, run by node against the server that E2B_API_URL, E2B_SANDBOX_URL and
// E2B_API_KEY name: create a sandbox, run commands, write and read a file, list, kill. Prints one JSON
// line (`RESULT {...}`) of what the SDK returned; tests/e2b/test_consumers_node.py checks it.
const { Sandbox, CommandExitError, NotFoundError } = require('e2b')

async function main() {
  const out = {}
  const sandbox = await Sandbox.create()
  out.sandboxId = sandbox.sandboxId

  const run = await sandbox.commands.run('echo "$GREETING from $(pwd)"; echo to-stderr >&2', {
    envs: { GREETING: 'hello' },
    cwd: '/tmp',
  })
  out.run = { stdout: run.stdout, stderr: run.stderr, exitCode: run.exitCode }

  try {
    await sandbox.commands.run('echo partial; exit 3')
    out.failed = null
  } catch (error) {
    out.failed = {
      isCommandExitError: error instanceof CommandExitError,
      exitCode: error.exitCode,
      stdout: error.stdout,
    }
  }

  const streamed = []
  await sandbox.commands.run('for i in 1 2 3; do echo line-$i; done', { onStdout: (data) => streamed.push(data) })
  out.streamed = streamed.join('')

  await sandbox.files.write('/home/user/notes/from-node.txt', 'written by node\n')
  out.read = await sandbox.files.read('/home/user/notes/from-node.txt')
  out.exists = await sandbox.files.exists('/home/user/notes/from-node.txt')
  out.listed = (await sandbox.files.list('/home/user/notes')).map((entry) => entry.name)
  out.catted = (await sandbox.commands.run('cat /home/user/notes/from-node.txt')).stdout

  const paginator = Sandbox.list()
  out.sandboxes = (await paginator.nextItems()).map((info) => info.sandboxId)

  await sandbox.kill()
  try {
    await Sandbox.connect(out.sandboxId)
    out.connectAfterKill = 'connected'
  } catch (error) {
    out.connectAfterKill = { notFound: error instanceof NotFoundError, name: error.name, message: error.message }
  }
  console.log('RESULT ' + JSON.stringify(out))
}

main().catch((error) => {
  console.error(error && error.stack ? error.stack : error)
  process.exit(1)
})

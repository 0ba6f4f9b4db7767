// The small built-in English text the generator learns its BPE merges from. Original prose written
// for this project; changing it changes every generated tokenizer (and so the model files).

export const CORPUS = `The river starts as a thin line of water high in the hills. In the morning the air is cold and
the grass is wet, and the water runs fast over the stones. By noon the sun has warmed the valley, and
the river is wider and slower. Farmers walk along the bank to check their fields, and children throw
small stones to see how far they can skip across the surface.

A good kitchen is a quiet place before dinner. Someone cuts onions on a wooden board, another person
washes the rice, and a pot of soup waits on the stove. The recipe says to add salt at the end, but the
cook tastes it first. Bread is baked in the evening, when the oven is already hot from the day.

The library opens at nine o'clock. People come to read the news, to borrow books, or simply to sit in a
warm room with a window. The librarian knows where every book should be, and she can find an old map
or a new novel in a few minutes. Students write their notes by hand, and some of them work until the
building closes at night.

Weather changes quickly near the sea. A bright morning can turn grey in an hour, and the wind brings
rain from the west. Sailors watch the clouds and listen to the radio before they leave the harbour.
When the storm has passed, the water is calm again, and the light on the waves is silver and gold.

Learning a language takes time and patience. First you learn the sounds, then simple words, and then
short sentences about the things around you: the table, the door, the weather, the people you meet.
Later you read stories and try to write letters. Mistakes are normal, and every mistake teaches you
something about the way the language works.

In the city the trains arrive every few minutes. Workers hurry to their offices, and the shops open
their doors one after another. A man sells coffee from a small cart at the corner of the street. He
remembers the faces of his customers and often knows what they want before they speak.

The garden needs water every evening during the summer. Tomatoes grow along the fence, beans climb the
poles, and flowers open in the early light. Birds come to eat the seeds, so the gardener hangs bright
ribbons that move in the wind. At the end of the season there is more food than one family can eat.

A computer follows simple rules very quickly. It reads numbers from memory, adds them, compares them,
and writes the results back. Programs are long lists of such steps, written by people who think
carefully about what should happen first and what should happen next. When a program has a bug, the
programmer reads the code again, line by line, until the problem becomes clear.

Music fills the old hall on Friday evenings. The players tune their instruments while the audience
finds their seats. When the first notes begin, the room becomes silent. Some people close their eyes,
and others watch the hands of the musicians as they move across the strings and keys.

Mountains are slow to change, but they do change. Ice and rain break the rock into smaller pieces, and
rivers carry the sand down to the plains. Over thousands of years the peaks become lower and the
valleys become deeper. A walker on the path sees only one afternoon of this long story.

Good friends share both ordinary days and important ones. They help each other move house, they bring
food when someone is ill, and they laugh together about small things. A friendship can last for many
years, even when people live in different countries and write to each other only a few times a year.

The market is busy on Saturday morning. There are apples, pears, cheese, fish, fresh eggs and honey.
Sellers call out their prices, and buyers count their coins. By the afternoon the tables are almost
empty, the square is quiet again, and the pigeons search the ground for the last crumbs of bread.

Numbers appear everywhere: 1, 2, 3, 10, 42, 100, 2048 and 65536. A clock shows 12:30, a ticket costs
$7.50, and the temperature is 21 degrees. Questions end with a question mark? Lists use commas, and
quotes look like "this" or 'that'. Some words are short (a, an, the) and some are long (understanding,
international, responsibility, extraordinary).
`
